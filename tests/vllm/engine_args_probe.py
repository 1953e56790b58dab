"""Run by vLLM's Python (tests/vllm/test_vllm_cli.py): vLLM server command lines (on stdin, a JSON
list of {"argv": [arguments after `python -m MODULE`], "env": {...}}) through vLLM's own CLI
parser, into its engine arguments and, as far as this machine allows, its engine config.  Prints
a JSON list, one object per command line (one process: importing vLLM costs ~20 s).

The parser is the one vLLM's OpenAI server builds (make_arg_parser on a FlexibleArgumentParser),
so a flag vLLM renamed or dropped is an error here (argparse exits 2 naming it), as it would be
when the replica starts."""

from __future__ import annotations

import contextlib
import io
import json
import sys


def parser():
    try:  # vLLM 0.32 moved the server's CLI here; older releases keep it under entrypoints.openai
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    return make_arg_parser(FlexibleArgumentParser(description="kvroute's probe of vLLM's CLI"))


def plain(value):
    """A JSON-able view of a config value (enums by name, dataclasses by their fields)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "name") and value.__class__.__module__.startswith(("enum", "vllm")) and hasattr(value, "value"):
        return value.name
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if hasattr(value, "__dataclass_fields__"):
        return {k: plain(getattr(value, k)) for k in value.__dataclass_fields__}
    if hasattr(value, "model_dump"):
        return plain(value.model_dump())
    return repr(value)


def main() -> int:
    import os

    results = []
    for case in json.loads(sys.stdin.read()):
        os.environ.update(case.get("env", {}))  # vllm.envs reads the environment when asked
        results.append(probe(case["argv"]))
    print(json.dumps(results))
    return 0


def probe(argv: list[str]) -> dict:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser().parse_args(argv)
    except SystemExit as exc:
        return {"parse_error": err.getvalue().strip().splitlines()[-1:], "exit": exc.code}
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine = AsyncEngineArgs.from_cli_args(args)
    fields = ("model", "served_model_name", "enable_prefix_caching", "block_size", "attention_backend",
              "tensor_parallel_size", "pipeline_parallel_size", "kv_events_config", "max_model_len",
              "enforce_eager", "distributed_executor_backend", "kv_cache_memory_bytes", "num_gpu_blocks_override")
    out = {"engine_args": {f: plain(getattr(engine, f, "<missing>")) for f in fields},
           "server_args": {f: plain(getattr(args, f, "<missing>")) for f in
                           ("host", "port", "enable_prompt_tokens_details", "api_key")},
           # the server's TLS (uvicorn's), from the launcher's --ssl-* flags
           "tls_args": {f: plain(getattr(args, f, "<missing>")) for f in
                        ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs", "ssl_cert_reqs")}}
    try:  # the whole engine config: model config, cache config, parallel config, device checks
        config = engine.create_engine_config()
        out["engine_config"] = {
            "block_size": config.cache_config.block_size,
            "enable_prefix_caching": config.cache_config.enable_prefix_caching,
            "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
            "served_model_name": plain(config.model_config.served_model_name),
            "kv_events_config": plain(config.kv_events_config),
            "attention_backend": plain(getattr(getattr(config, "attention_config", None), "backend", None)),
        }
    except Exception as exc:  # noqa: BLE001 - reported, the test decides
        out["engine_config_error"] = f"{type(exc).__name__}: {exc}"[:2000]
    return out


if __name__ == "__main__":
    sys.exit(main())
