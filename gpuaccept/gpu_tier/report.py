"""The tier's outputs: gpu_tier.json and the Markdown report rendered from it."""

from __future__ import annotations

import json
from typing import Any

from gpuaccept.gpu_tier.ctx import Ctx


def write_outputs(ctx: Ctx) -> None:
    ctx.result["checks"] = [{"name": n, "ok": ok, "detail": d} for n, ok, d in ctx.checks]
    ctx.result["all_ok"] = all(ok for _, ok, _ in ctx.checks)
    if ctx.log_tee is not None:
        ctx.result["supervisor_log_lines"] = ctx.log_tee.lines[-200:]
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "gpu_tier.json").write_text(json.dumps(ctx.result, indent=2, default=str) + "\n")
    (ctx.out / "gpu_tier.md").write_text(render_md(ctx.result))
    print(f"\nwrote {ctx.out / 'gpu_tier.json'} and {ctx.out / 'gpu_tier.md'}", flush=True)


def _f(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def render_md(r: dict[str, Any]) -> str:
    sections = (_summary_md, _facts_md, _orphans_md, _holder_md, _supervisor_md, _bench_md)
    return "\n".join(line for section in sections for line in section(r)) + "\n"


def _summary_md(r: dict[str, Any]) -> list[str]:
    m = r.get("meta", {})
    out = [
        "# kimi-supervisor GPU tier",
        "",
        f"- host: {m.get('host')}; GPUs: {m.get('ngpu')}; driver {m.get('driver')}; NVML {m.get('nvml')}; "
        f"torch {m.get('torch')}; nvidia-ml-py {m.get('nvidia_ml_py')}; psutil {m.get('psutil')}; "
        f"python {m.get('python')}; fake={m.get('fake')}",
        f"- started {m.get('started')}; took {m.get('wall_s')} s; env {json.dumps(m.get('safe_env'))}",
        f"- all checks passed: **{r.get('all_ok')}**",
        "",
        "## Expectations",
        "",
        "| check | result | detail |",
        "| --- | --- | --- |",
    ]
    for c in r.get("checks", []):
        out.append(f"| {c['name']} | {'PASS' if c['ok'] else '**FAIL**'} | {str(c['detail']).replace('|', '/')} |")
    out += [
        "",
        f"- processes of this run still alive at exit and SIGKILLed by the final sweep: {r.get('swept_at_exit')}",
    ]
    if r.get("errors"):
        out += ["", "## Errors", "", "```", *r["errors"], "```"]
    return out


def _facts_md(r: dict[str, Any]) -> list[str]:
    out: list[str] = []
    f = r.get("facts", {})
    if f:
        out += [
            "",
            "## a. NVML facts",
            "",
            "| GPU | when | v1 used | v2 used | v2 reserved | total | processes |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for when in ("idle", "loaded"):
            for row in f.get(when, []):
                procs = (
                    ", ".join(
                        f"{p.get('kind', '')} PID {p.get('pid')} {p.get('used_mib')} MiB "
                        f"({'in /proc' if p.get('in_proc', True) else 'NOT in /proc'}, {p.get('comm')})"
                        for p in row.get("procs", [])
                        if "pid" in p
                    )
                    or "none"
                )
                out.append(
                    f"| {row['gpu']} | {when} | {_f(row.get('v1_used_mib'))} | {_f(row.get('v2_used_mib'))} | "
                    f"{_f(row.get('v2_reserved_mib'))} | {_f(row.get('v2_total_mib', row.get('v1_total_mib')))} | "
                    f"{procs} |"
                )
    return out


def _orphans_md(r: dict[str, Any]) -> list[str]:
    out: list[str] = []
    o = r.get("orphans", {})
    if o:
        out += ["", "## b. Orphans + decoys", ""]
        out.append(
            f"- tree up in {o.get('tree_start_s')} s; workers: "
            + "; ".join(
                f"PID {w['pid']} GPU {w['gpu']} {json.dumps({k: v for k, v in w.items() if k not in ('pid', 'gpu', 'shm_after_init')})}"
                for w in o.get("workers", [])
            )
        )
        out.append(
            "- names (psutil name() / comm / cmdline): "
            + "; ".join(
                f"{pid} {n['role']}: {n['psutil_name']!r} / {n['comm']!r} / {' '.join(n['cmdline'])[:80]!r}"
                for pid, n in o.get("names", {}).items()
            )
        )
        out.append(
            f"- /dev/shm files new while the tree ran: {o.get('shm_new_with_tree')}; seen by workers right "
            f"after NCCL init: {o.get('shm_seen_by_workers')}; after orphaning: {o.get('shm_after_orphaning')}"
        )
        out.append(
            f"- orphans' ppid after the parent's SIGKILL: {o.get('orphan_ppids')}; "
            f"used MiB while orphaned: {o.get('used_mib_orphaned')}"
        )
        out.append(
            f"- dry run {o.get('dry_run_s')} s; real run {o.get('real_run_s')} s (total preflight wall time)"
            f"{'; error: ' + o['real_run_error'] if o.get('real_run_error') else ''}"
        )
        out += [
            "",
            "Dry run report:",
            "",
            "```",
            *o.get("dry_run_report", []),
            "```",
            "",
            "Real run report:",
            "",
            "```",
            *o.get("real_run_report", []),
            "```",
            "",
        ]
        out += [
            "Signals (ms after the real run began): "
            + ", ".join(f"{s['sig']}→{s['pid']} @{s['t_ms']}" for s in o.get("signals", [])),
            "",
        ]
        out += [
            "| GPU | PID | SIGTERM→memory ≤1000 MiB (ms) | →baseline (ms) | →NVML stops listing PID (ms) | "
            "→exited (Z or gone) (ms) | zombie seen | →reaped (ms) | zombie for (ms) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for g in o.get("per_gpu", []):
            out.append(
                f"| {g['gpu']} | {g['pid']} | {_f(g.get('memory_below_threshold_ms'))} | "
                f"{_f(g.get('memory_at_baseline_ms'))} | {_f(g.get('nvml_pid_gone_ms'))} | "
                f"{_f(g.get('exited_ms'))} | {g.get('zombie_seen')} | {_f(g.get('reaped_ms'))} | "
                f"{_f(g.get('zombie_for_ms'))} |"
            )
        out += [
            "",
            "State timelines (ms after SIGTERM, /proc state letter, '-' = reaped): "
            + "; ".join(f"PID {g['pid']}: {g.get('states')}" for g in o.get("per_gpu", [])),
        ]
    return out


def _holder_md(r: dict[str, Any]) -> list[str]:
    out: list[str] = []
    h = r.get("holder", {})
    if h:
        out += [
            "",
            "## b(ii). Non-matching GPU holder",
            "",
            f"- holder PID {h.get('holder_pid')} (comm 'trainer'), GPU 0 used {h.get('used_mib_gpu0')} MiB",
            f"- real preflight (deadline 5 s) raised after {h.get('real_run_s')} s, exit code "
            f"{h.get('exit_code')}: `{h.get('error')}`",
            f"- holder's own memory back {h.get('holder_memory_back_after_sigterm_s')} s after its SIGTERM",
            "",
            "Dry run:",
            "",
            "```",
            *h.get("dry_run_report", []),
            "```",
        ]
    return out


def _supervisor_md(r: dict[str, Any]) -> list[str]:
    out: list[str] = []
    s = r.get("supervisor", {})
    if s:
        out += [
            "",
            "## c. Supervisor stop",
            "",
            f"- `{s.get('command')}`",
            f"- ready (state.ready) {s.get('ready_after_s')} s after launch; tree {s.get('tree')}; "
            f"used MiB while serving {s.get('used_mib_serving')}",
            f"- SIGTERM → exit {s.get('exit_after_s')} s, exit code {s.get('exit_code')}",
            f"- every descendant dead (Z or gone) {s.get('all_descendants_dead_s')} s, reaped "
            f"{s.get('all_descendants_reaped_s')} s; GPU memory ≤1000 MiB per GPU (s): {s.get('gpu_memory_back_s')}",
            f"- strays: {s.get('strays')}; used MiB after: {s.get('used_mib_after')}",
            "",
            "| event | s after SIGTERM | fields |",
            "| --- | --- | --- |",
        ]
        for k, v in s.get("events_after_sigterm", {}).items():
            fields = {a: b for a, b in v.items() if a not in ("at_s", "event", "timestamp", "level")}
            out.append(f"| {k} | {v.get('at_s')} | {json.dumps(fields)[:200]} |")
        out += ["", "Config:", "", "```toml", *s.get("config", []), "```"]
    return out


def _bench_md(r: dict[str, Any]) -> list[str]:
    out: list[str] = []
    b = r.get("bench", {})
    if b.get("table"):
        out += [
            "",
            f"## d. Benchmark on clean GPUs ({b.get('reps')} reps each)",
            "",
            "| what | median ms | p95 ms | × warm preflight median |",
            "| --- | --- | --- | --- |",
        ]
        for row in b["table"]:
            out.append(
                f"| {row['what']} | {row['median_ms']:.2f} | {row['p95_ms']:.2f} | {row['x_warm_preflight']:.2f} |"
            )
        out += [
            "",
            f"- preflight config: {b.get('preflight_config')}",
            f"- seed loop (sum) as run: `bash -c '{b['seed_loop_sum']['script']}'` exit codes "
            f"{b['seed_loop_sum']['exit_codes']}",
            f"- seed loop (per-GPU max) as run: `bash -c '{b['seed_loop_max']['script']}'` exit codes "
            f"{b['seed_loop_max']['exit_codes']}",
            f"- nvidia-smi output: {b.get('nvidia_smi_output')}",
        ]
        if b.get("nvml_latency_us"):
            out += ["", "| NVML call (GPU 0) | median µs | p95 µs | mean µs |", "| --- | --- | --- | --- |"]
            for k, v in b["nvml_latency_us"].items():
                if isinstance(v, dict):
                    out.append(f"| {k} | {v['median']} | {v['p95']} | {v['mean']} |")
                else:
                    out.append(f"| {k} | {v} (ms) | | |")
    return out
