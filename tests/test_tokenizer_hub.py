"""A tokenizer given as a Hugging Face model id, resolved through huggingface_hub's cache.

No network here: the tests build a Hub cache holding the tiny tokenizer under a made-up id, in
huggingface_hub's own layout (``models--org--name/{blobs,refs/main,snapshots/<commit>}``, files
as symlinks to blobs named by their git hash; ``scan_cache_dir`` reads it back to prove the
layout), point ``HF_HUB_CACHE`` at it and set ``HF_HUB_OFFLINE=1``: a router process started with
``--tokenizer org/name`` must find it there, and fail at startup, saying why, for an id the
cache lacks.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from huggingface_hub import scan_cache_dir
from huggingface_hub.file_download import repo_folder_name

from kvroute.replica.assets import TINY_TOKENIZER
from kvroute.common.tokens.hub import hub_model_id, tokenizer_dir
from tests.router_support import RouterProcess, emulated_replicas, scrape, total

MODEL_ID = "kvroute-test/tiny-tokenizer"
COMMIT = hashlib.sha1(b"kvroute test snapshot").hexdigest()
REPO = Path(__file__).resolve().parents[1]


def git_blob_hash(data: bytes) -> str:
    """What the Hub names a non-LFS file's blob: its git object id."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def build_hub_cache(cache: Path, repo_id: str, files: Path) -> Path:
    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for src in sorted(files.iterdir()):
        data = src.read_bytes()
        blob = repo / "blobs" / git_blob_hash(data)
        blob.write_bytes(data)
        (snapshot / src.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.fixture
def offline_hub(tmp_path) -> dict[str, str]:
    """The environment of a process that sees only the test's Hub cache, offline."""
    cache = tmp_path / "hub"
    build_hub_cache(cache, MODEL_ID, TINY_TOKENIZER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return env | {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
                  "PYTHONPATH": str(REPO)}


def test_the_test_cache_is_laid_out_as_huggingface_hub_reads_it(tmp_path):
    build_hub_cache(tmp_path, MODEL_ID, TINY_TOKENIZER)
    (repo,) = scan_cache_dir(tmp_path).repos
    assert repo.repo_id == MODEL_ID and repo.repo_type == "model"
    (revision,) = repo.revisions
    assert revision.commit_hash == COMMIT and revision.refs == frozenset({"main"})
    assert {f.file_name for f in revision.files} == {"tokenizer.json", "tokenizer_config.json"}


def test_paths_stay_paths_and_an_existing_directory_wins_over_an_id(tmp_path, monkeypatch):
    assert hub_model_id(str(TINY_TOKENIZER)) is None
    assert hub_model_id("./models/x") is None and hub_model_id("~/x") is None and hub_model_id("a/b/c") is None
    assert hub_model_id("org/name") == ("org/name", None)
    assert hub_model_id("org/name@v2") == ("org/name", "v2")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub_model_id("org/name") is None
    assert tokenizer_dir("org/name") == Path("org/name")


async def test_router_resolves_a_model_id_from_the_hub_cache_offline(offline_hub):
    async with emulated_replicas(1) as reps:
        router = await RouterProcess.start([r.url for r in reps], tokenizer=MODEL_ID, env=offline_hub)
        try:
            client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
            reply = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hello from the hub cache " * 20}], max_tokens=2
            )
            await client.close()
            # The router cut the prompt into the tokens the replica counted: it loaded the tokenizer.
            samples = await scrape(router.url)
            assert reply.usage.prompt_tokens > 50
            assert total(samples, "kvroute_prompt_tokens_total", model="tiny") == reply.usage.prompt_tokens
        finally:
            await router.stop()


def test_a_model_id_missing_from_the_cache_offline_is_a_clear_startup_error(offline_hub):
    done = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "router", "--host", "127.0.0.1", "--port", "0",
         "--replicas", "http://127.0.0.1:9", "--tokenizer", "kvroute-test/absent"],
        capture_output=True, text=True, timeout=60, env=offline_hub, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 2
    assert "kvroute-test/absent" in done.stderr and "HF_HUB_OFFLINE" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
