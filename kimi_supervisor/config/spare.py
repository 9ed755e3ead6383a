"""A hot spare's config (docs/spare.md): `NAME.spare.toml`, role "spare", whose child is its engine's.

The spare exists so that the front can send a request to it while the engine does not serve, and the client gets
the engine's answer: the same model, dtype, quantization, parsers, max length and sampling defaults.  So its argv is
not written twice, where the two could drift apart: it is the engine's (`NAME.toml` beside it), with only the flags
that size its memory (`[spare]`) and its socket (`<runtime>/NAME/front/spare.sock`, beside the engine's, where
the front reaches both) replaced.  Its environment,
user, group, working directory and credentials are the engine's too; its NCCL RAS port is its own
(config/gpu_pinning.py slot 2).  What would let the two answer differently is refused here, exit 78, one line
naming the file, the key and the value.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from kimi_supervisor.config.front import SOCKET_DIR, SPARE_SOCKET_NAME
from kimi_supervisor.config.gpu_pinning import NCCL_RAS_ADDR
from kimi_supervisor.config.model import ChildConfig, Config, PathsConfig, PreflightConfig, SpareConfig
from kimi_supervisor.config.table import Table, short_repr
from kimi_supervisor.config.vllm_args import option_name, parse_vllm_args
from kimi_supervisor.config.vllm_yaml import expand
from kimi_supervisor.exitcodes import ConfigError

# The flags that are the spare's own: its socket, and what sizes its memory (not its tokens).  Every other flag of
# the engine's argv is the spare's unchanged.
SOCKET_FLAG = "--uds"
MEMORY_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization", "--max-num-seqs")
# vLLM fits "auto" (or -1) to the KV cache it found (engine/arg_utils.py, model_config.max_model_len = -1): the
# spare's smaller one would give it a shorter max length, so a long request the engine takes would fail on it, and
# the render route's default max_tokens (what is left of the max length) would differ.
FITTED_MAX_MODEL_LEN = frozenset({"auto", "-1"})


def socket_path(runtime_directory: Path, name: str) -> Path:
    """The spare's --uds socket: beside the engine's (config/front.py), which the front's account alone reaches."""
    return runtime_directory / name / SOCKET_DIR / SPARE_SOCKET_NAME


def engine_config_path(spare_config: Path, name: str) -> Path:
    """Its engine's config: NAME.toml beside NAME.spare.toml (roles.py config_name)."""
    return spare_config.parent / f"{name}.toml"


def _value(argv: Sequence[str], i: int) -> tuple[str, str | None, int]:
    """(option name, its value or None, the words it takes) of argv[i], `--x v` or `--x=v`."""
    name, eq, inline = option_name(argv[i]).partition("=")
    if eq:
        return name, inline, 1
    # A value may start with one dash (`--max-model-len -1`), never with two.
    if name.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
        return name, argv[i + 1], 2
    return name, None, 1


def without(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """`argv` without each of `flags` and its value (every occurrence: vLLM's argparse keeps the last one)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        name, _, width = _value(argv, i)
        if i > 0 and name in flags:
            i += width
            continue
        out.append(argv[i])
        i += 1
    return out


def option_values(argv: Sequence[str], flag: str) -> list[str]:
    return [v for i in range(1, len(argv)) for name, v, _ in [_value(argv, i)] if name == flag and v is not None]


def output_key(argv: Sequence[str], env: dict[str, str]) -> str:
    """What decides an engine's tokens, hashed: its argv without the spare's own flags, its environment without
    the RAS port (each supervisor's own).  A spare's is its engine's by construction; it is recorded in the spare's
    state file so that an engine config edited since the spare started shows (docs/spare.md)."""
    kept = without(argv, (SOCKET_FLAG, *MEMORY_FLAGS))
    env_kept = {k: v for k, v in sorted(env.items()) if k != NCCL_RAS_ADDR}
    return hashlib.sha256(json.dumps([kept, env_kept]).encode()).hexdigest()


def engine_kv_bytes(argv: Sequence[str], engine_path: Path) -> int | None:
    """The engine's own --kv-cache-memory-bytes (the last one), in bytes; None when it sizes its cache by fraction."""
    values = option_values(argv, "--kv-cache-memory-bytes")
    if not values:
        return None
    raw = values[-1].strip()
    # vLLM's human_readable_int (utils/argparse_utils.py): 8G is binary (GiB), 8g decimal; a plain integer is bytes.
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    scale = units.get(raw[-1:], 1)
    try:
        return int(float(raw[:-1]) * scale) if scale != 1 else int(raw)
    except ValueError:
        raise ConfigError(
            f"{engine_path}: child.argv: --kv-cache-memory-bytes {short_repr(values[-1])}: expected a number of bytes "
            "(the spare's memory plan counts it)"
        ) from None


def spare_argv(engine_argv: Sequence[str], socket: Path, spare: SpareConfig) -> tuple[str, ...]:
    """The engine's argv with the spare's socket and memory flags in place of the engine's."""
    out = without(engine_argv, (SOCKET_FLAG, *MEMORY_FLAGS))
    out += [SOCKET_FLAG, str(socket), "--kv-cache-memory-bytes", str(spare.kv_cache_memory_bytes)]
    out += ["--gpu-memory-utilization", f"{spare.gpu_memory_utilization:g}"]
    if spare.max_num_seqs is not None:
        out += ["--max-num-seqs", str(spare.max_num_seqs)]
    return tuple(out)


# [spare]'s required keys, and why each is: the message of a config without it.
REQUIRED = {
    "kv_cache_memory_bytes": "the spare's own KV cache per GPU in bytes (vLLM's --kv-cache-memory-bytes); without it "
    "vLLM would size its cache from the memory the engine needs",
    # vLLM checks free >= utilization x total - the held weights even with --kv-cache-memory-bytes
    # (v1/worker/utils.py:716-759): its 0.92 default would fail beside a serving engine, after the spare's start.
    "gpu_memory_utilization": "vLLM checks that this fraction of each GPU, less the held weights, is free when the "
    "spare starts, beside the serving engine (its default 0.92 never is)",
}


def parse_spare(t: Table, engine_path: Path) -> SpareConfig:
    """[spare] of a spare's config; ConfigError naming the file and key."""
    for key, why in REQUIRED.items():
        if not t.has(key):
            raise t.error(key, f"required key is missing: {why}")
    cfg = SpareConfig(
        engine_config=engine_path,
        kv_cache_memory_bytes=t.integer("kv_cache_memory_bytes", 0, minimum=1 << 20, maximum=1 << 50),
        gpu_memory_utilization=t.number("gpu_memory_utilization", 0.0, maximum=1.0),
        max_num_seqs=t.integer("max_num_seqs", 0, minimum=1, maximum=1 << 20) if t.has("max_num_seqs") else None,
        overhead_mib=t.integer("overhead_mib", SpareConfig.overhead_mib, minimum=0, maximum=1 << 24),
        margin_mib=t.integer("margin_mib", SpareConfig.margin_mib, minimum=0, maximum=1 << 24),
    )
    t.done()
    return cfg


def check_engine(engine: Config, engine_path: Path, takes_spare: bool) -> None:
    """Refuse an engine a spare cannot stand in for, naming the engine's file, key and value."""
    if not takes_spare:
        raise ConfigError(
            f"{engine_path}: deployment.role: {engine.role.value!r}: a spare stands in for a one-host engine "
            '(role = "engine")'
        )
    if engine.weights is None:
        raise ConfigError(
            f"{engine_path}: weights.holder: false: a spare maps its engine's held weights (docs/spare.md); a second "
            "copy does not fit beside them: set [weights] holder = true"
        )
    vllm = engine.child.vllm
    if vllm.uds is None:
        raise ConfigError(
            f"{engine_path}: child.argv has no --uds: the front reaches the engine and its spare on their Unix "
            "sockets (docs/front.md); the spare would take the engine's TCP port"
        )
    for value in option_values(engine.child.argv, "--max-model-len"):
        if value.lower() in FITTED_MAX_MODEL_LEN:
            raise ConfigError(
                f"{engine_path}: child.argv: --max-model-len {short_repr(value)}: vLLM fits it to each engine's KV "
                "cache, so the spare's smaller cache would give it a shorter max length than the engine's: give a "
                "number"
            )


def check_beside(spare_path: Path, engine: Config, paths: PathsConfig, given_gpus: bool, pf: PreflightConfig) -> None:
    """The spare's own tables agree with its engine's where they must: the same directories (the holder's sockets,
    the front's socket directory) and the same GPUs."""
    for key in ("runtime_directory", "state_directory"):
        mine, theirs = getattr(paths, key), getattr(engine.paths, key)
        if mine != theirs:
            raise ConfigError(
                f"{spare_path}: paths.{key}: {str(mine)!r}: the spare's is its engine's "
                f"({engine.path}: {str(theirs)!r})"
            )
    if given_gpus and pf.gpus != engine.preflight.gpus:
        theirs = "all" if engine.preflight.gpus is None else list(engine.preflight.gpus)
        mine = "all" if pf.gpus is None else list(pf.gpus)
        raise ConfigError(
            f"{spare_path}: preflight.gpus: {mine}: the spare runs on its engine's GPUs ({engine.path}: {theirs}): "
            "remove the key"
        )


def derive_child(engine: Config, socket: Path, spare: SpareConfig) -> ChildConfig:
    """The engine's child, its argv with the spare's socket and memory flags, its RAS port left for the spare's
    own (config/load.py pins it as the spare's role says)."""
    argv = spare_argv(engine.child.argv, socket, spare)
    env = {k: v for k, v in engine.child.env.items() if k != NCCL_RAS_ADDR}
    seen, yaml_file = expand(argv, engine.child.working_directory)  # as config/load.py reads the engine's
    vllm = parse_vllm_args(seen)
    if yaml_file is not None:
        vllm = dataclasses.replace(vllm, config_file=str(yaml_file))
    return dataclasses.replace(engine.child, argv=argv, env=env, vllm=vllm)
