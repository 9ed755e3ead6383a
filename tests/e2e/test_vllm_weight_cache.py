"""The weight holder's config checks against vLLM 0.32's code (docs/weight-holder.md): its socket path, as the daemon
binds it (weight_cache/protocol.py get_socket_path), is the one config/weights.py measures."""

from __future__ import annotations

import json
from pathlib import Path

from kimi_supervisor.config.weights import key_mismatch, longest_socket_path, weights_key
from tests.e2e.vllm_python import VllmPython

PROBE = """
import json, sys
from vllm.model_executor.model_loader.weight_cache.protocol import get_socket_path
d = sys.argv[1]
print(json.dumps([get_socket_path("GPU-0e3b7c1a-aaaa-bbbb-cccc-0123456789ab", d, is_draft=x) for x in (False, True)]))
"""


def test_socket_paths_are_as_long_as_vllms_own(vllm_python: VllmPython) -> None:
    sockets = Path("/run/kimi-supervisor/abcdefghijklmnopq/weight-cache")  # a path's length, nothing made there
    result = vllm_python.run(PROBE, [str(sockets)])
    assert result.returncode == 0, result.stderr[-2000:]
    target, draft = json.loads(result.stdout.strip().splitlines()[-1])
    spec = ["--speculative-config", json.dumps({"method": "mtp"})]
    assert len(longest_socket_path(sockets, ["vllm", "preload"])) == len(target) == 107
    assert len(longest_socket_path(sockets, ["vllm", "preload", *spec])) == len(draft) == 113


PARSE = """
import json, sys
from vllm.config.model import str_dtype_to_torch_dtype
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
EngineArgs.add_cli_args(parser)
out = []
for argv in json.loads(sys.argv[1]):
    ns = parser.parse_args(argv)
    dtype = str(str_dtype_to_torch_dtype(ns.dtype) or ns.dtype)
    out.append([ns.model, ns.tensor_parallel_size, ns.pipeline_parallel_size, ns.data_parallel_size, dtype,
                ns.quantization, ns.revision, ns.enable_expert_parallel])
print(json.dumps(out))
"""

SPELLINGS = [
    ["--model", "/m", "-tp", "8", "--dtype", "bfloat16"],
    ["--model", "/m", "--tensor-parallel-size=08", "--dtype=bfloat16"],
    ["--model", "/m", "-tp", "8", "--dtype", "half"],
    ["--model", "/m", "-tp", "8", "--dtype", "float16"],
    ["--model", "/m", "-tp", "8", "--dtype", "bfloat16", "-ep"],
    ["--model", "/m", "-tp", "8", "--dtype", "bfloat16", "-ep", "--no-enable-expert-parallel"],
    ["--model", "/m", "-tp", "8", "--dtype", "bfloat16", "-pp", "1", "-dp", "1"],
]


def test_our_key_is_equal_exactly_where_vllms_parsed_values_are(vllm_python: VllmPython) -> None:
    """vLLM's own parser on each spelling: two argvs make equal keys here exactly when vLLM parses them to equal
    values (its dtype mapped as config/model.py does), expert parallelism included."""
    result = vllm_python.run(PARSE, [json.dumps(SPELLINGS)])
    assert result.returncode == 0, result.stderr[-2000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    ours = [weights_key(["vllm", "serve", *argv]) for argv in SPELLINGS]
    for i in range(len(SPELLINGS)):
        for j in range(len(SPELLINGS)):
            assert (parsed[i] == parsed[j]) == (key_mismatch(dict(ours[i]), ours[j]) == []), (
                i,
                j,
                parsed[i],
                parsed[j],
            )
