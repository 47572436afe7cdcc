"""The KV handoff and the many-users runs (`python -m bench.e2e.kv_transfer`, `bench.e2e.deployments`,
`bench.e2e.auto_thresholds`), rendered into docs/results.md by `python -m bench.readme_tables` from their
files and the runs each keeps under `previous`; and NIXL's descriptors (`bench.micro.nixl_descriptors`),
rendered into docs/nixl.md."""

from __future__ import annotations

import re
from collections.abc import Callable

from bench.history import LOAD_2X_LABELS, Doc, about, caption, link, load, run_at, span, whole
from bench.markdown import table

GB = 1e9


# --- the KV handoff -----------------------------------------------------------------------------
def newest(rows: list[Doc], test: Callable[[Doc], bool]) -> list[Doc]:
    """The rows that pass `test` from the newest commit that has any (a file's rows run oldest first)."""
    kept = [r for r in rows if test(r)]
    if not kept:
        return []
    last = kept[-1]["commit"]
    return [r for r in kept if r["commit"] == last]


def took(rows: list[Doc], digits: int = 2, rate: bool = False) -> str:
    """The rows' times, low-high in ms, with their rate in GB/s."""
    text = span([r["seconds"] * 1e3 for r in rows], digits, " ms")
    return text + (f" ({span([r['bytes'] / r['seconds'] / GB for r in rows], 0, ' GB/s', widen=False)})"
                   if rate else "")


def kv_handoff() -> str:
    """A 32k prompt's KV moved between the servers' pools, each cell from the newest commit measured so."""
    two = load("kv_transfer-2xh200.json")["rows"]
    one, cpu = load("kv_transfer-h200.json"), load("kv_transfer-cpu.json")

    def ends(kv: str, blocks: str, timed: str | None = None) -> list[Doc]:
        return newest(two, lambda r: (r["transport"], r["mode"], r.get("blocks")) == (kv, "endpoints", blocks)
                      and r.get("timed_from") == timed)

    def servers(rows: list[Doc], kv: str) -> list[Doc]:
        return newest(rows, lambda r: (r["transport"], r["mode"]) == (kv, "servers") and not r.get("beside_nixl"))

    nccl_ready, nccl_first = ends("nccl", "contiguous", "kv-ready"), ends("nccl", "contiguous", "first-call")
    nccl_scattered = ends("nccl", "scattered", "first-call")
    ipc, ipc_scattered = ends("cuda-ipc", "contiguous"), ends("cuda-ipc", "scattered")
    used = nccl_ready + nccl_first + nccl_scattered + ipc + ipc_scattered

    def exposed(rows: list[Doc], median: bool = False) -> str:
        values = sorted(r["exposed_ms"] for r in rows)
        low, high = (f"{v:.2f}" if v < 10 else f"{v:,.0f}" for v in (values[0], values[-1]))
        return f"{low}-{high} ms" + (f" (median {values[len(values) // 2]:.2f})" if median else "")

    def same(rows: list[Doc]) -> str:
        return "yes" if rows and all(r["bitwise_equal"] for r in rows) else "**no**"

    nvlink = "2×H200, NVLink"
    shared = "H200, both servers on one GPU"
    rows = []
    nccl_servers = servers(two, "nccl")
    rows.append([nvlink, "nccl", f"{took(nccl_ready, rate=True)} from the KV ready, sends queued as in the servers; "
                 f"{took(nccl_first)} from the sender's first call; scattered blocks {took(nccl_scattered, 1)}",
                 took(nccl_servers, 1), exposed(nccl_servers, median=True),
                 same(nccl_ready + nccl_first + nccl_servers)])
    ipc_servers = servers(two, "cuda-ipc")
    rows.append([nvlink, "cuda-ipc", f"{took(ipc, rate=True)}; scattered blocks {took(ipc_scattered, 1)}",
                 took(ipc_servers, 1), exposed(ipc_servers), same(ipc + ipc_scattered + ipc_servers)])
    for kv in ("cuda-ipc", "grpc"):
        held = [r for r in one["rows"] if (r["transport"], r["mode"]) == (kv, "servers") and not r.get("commit")]
        beyond = span([r["seconds"] for r in held], 2, " s") if kv == "grpc" else took(held, 1)
        rows.append([shared, kv, "-", beyond, exposed(held), same(held)])
    ends_cpu = cpu["rows"]
    rows.append(["CPU, 2 cores, two processes", "grpc",
                 span([r["seconds"] for r in ends_cpu], 2, " s") + " ("
                 + span([r["bytes"] / r["seconds"] / GB for r in ends_cpu], 2, " GB/s") + ")", "-", "-",
                 same(ends_cpu)])
    mine = used + nccl_servers + ipc_servers
    commits = ", ".join(dict.fromkeys(r["commit"] for r in mine))
    commands = "`, `".join(dict.fromkeys(r["command"] for r in mine))
    header = ["where", "transport", "32k tokens, nothing to hide under", "beyond the prefill, servers",
              "exposed after the last layer", "bit for bit"]
    days = sorted(r["date"][:10] for r in mine)
    dates = days[0] if days[0] == days[-1] else f"{days[0]} to {days[-1]}"
    sources = [f"{link('kv_transfer-2xh200.json')}: 2x NVIDIA H200, {dates}, the rows of {commits}, `{commands}`",
               f"{link('kv_transfer-h200.json')}: {one['hardware'].split(' (')[0]}, {one['date'][:10]}, commit "
               f"{one['commit']}, `PD_VERIFY_KV=1`, `" + "`, `".join(one["commands"]) + "`",
               f"{link('kv_transfer-cpu.json')}: {cpu['hardware']}, {cpu['date'][:10]}, commit {cpu['commit']}, "
               f"`{cpu['command']}`"]
    return caption(*sources) + "\n\n" + table(header, rows)


def nixl_descriptors() -> str:
    """One request's WRITEs made both ways, every layer's: by index into the lists prepared at pairing, and
    as descriptors built per transfer from the runs of slots contiguous on both sides (`merged`)."""
    file = "nixl_descriptors-cpu.json"
    doc = load(file)
    by: dict[tuple[int, str], dict[str, Doc]] = {}
    for r in doc["rows"]:
        by.setdefault((r["tokens"], r["blocks"]), {})[r["method"]] = r
    rows = []
    for (tokens, blocks), way in by.items():
        posted = dict.fromkeys(f"{way[m]['descriptors_posted_a_layer']:,}" for m in ("prepared", "merged"))
        rows.append([f"{tokens // 1024}k", blocks, f"{way['prepared']['make_ms']:.1f} ms",
                     f"{way['merged']['make_ms']:.1f} ms", " / ".join(posted)])
    same = "" if all(r["bitwise_equal"] for r in doc["rows"]) else "**not** "
    header = ["tokens", "blocks", "prepared", "per-transfer runs", "descriptors UCX got a layer (both)"]
    return (caption(about(doc, file), f"`UCX_TLS={doc['ucx_tls']}`; bytes {same}identical in every row")
            + "\n\n" + table(header, rows))


# --- many users ---------------------------------------------------------------------------------
def load_cells(run: Doc, itl_median: bool = True) -> list[str]:
    """requests, ITL (median), p99 and max, TTFT median and the long prompts' TTFT median, goodput."""
    itl = run["itl_ms"]
    return [str(run["completed"]), *([f"{itl['p50']:.1f} ms"] if itl_median else []), f"{whole(itl['p99'])} ms",
            f"{whole(itl['max'])} ms", f"{run['ttft_ms']['p50']:,.0f} ms",
            f"{run['long_prompt_ttft_ms']['p50']:,.0f} ms", f"{run['goodput_rps']:.2f} req/s"]


def slo(params: Doc) -> str:
    return f"goodput ({params['slo_ttft_ms'] / 1e3:g} s, {params['slo_itl_ms']:g} ms)"


def load_label(name: str, run: Doc, servers: list[str]) -> str:
    """A mode's label; partitioned's SM count from its run, or from the server's `--prefill-sms`."""
    if name.startswith("chunked-"):
        return f"chunked, {int(name.split('-')[1]):,}"
    if name != "partitioned":
        return name
    given = [m[1] for command in servers if (m := re.search(r"--prefill-sms (\d+)", command))]
    sms = run.get("prefill_sms") or (given[0] if given else None)
    return f"{name}, {sms} SMs" if sms else name


def load_h200_c40eebd() -> str:
    """One decode server on one H200 without its prefix cache, the same seeded load in every mode."""
    file = "load-h200.json"
    run = run_at(file, "c40eebd")
    rows = [[load_label(name, r, run.get("servers", [])), *load_cells(r)] for name, r in run["runs"].items()
            if name not in ("prefix-cache", "no-prefix-cache")]
    header = ["mode", "requests", "ITL median", "ITL p99", "ITL max", "TTFT median", "long prompts' TTFT median",
              slo(run["params"])]
    return caption(about(run, file, "(under `previous`)")) + "\n\n" + table(header, rows)


def prefix_cache_h200() -> str:
    """Conversations of four turns against two decode servers on one H200, one with its prefix cache."""
    file = "load-h200.json"
    run = run_at(file, "c40eebd")
    rows = []
    for name, label in (("prefix-cache", "with the prefix cache"), ("no-prefix-cache", "without")):
        r = run["runs"][name]
        rows.append([label, str(r["completed"]), f"{r['first_turn_ttft_ms']['p50']:,.0f} ms",
                     f"{r['later_turn_ttft_ms']['p50']:,.0f} ms", f"{r['cached_prompt_frac']:.0%}",
                     f"{r['goodput_rps']:.2f} req/s"])
    added = run["runs"]["prefix-cache"]["recorded"]
    header = ["", "requests", "TTFT median, first turns", "TTFT median, later turns", "prompt tokens from the cache",
              "goodput"]
    return (caption(f"{run['hardware']}, {added['date'][:10]}, commit {added['commit']}, `{added['command']}`, "
                    f"{link(file)} (the runs `prefix-cache` and `no-prefix-cache` of its run at {run['commit']})")
            + "\n\n" + table(header, rows))


def load_2xh200_sweep() -> str:
    """The multi-turn rate sweep on two H200s beside the simulator's prediction recorded before it."""
    file = "load-2xh200.json"
    doc = load(file)
    rates = [p["rate"] for p in next(iter(doc["sweep"].values()))]
    top = rates[-1]
    predicted = {(c["deployment"], c["rate"]): c["predicted_goodput_rps"] for c in doc["prediction_compared"]}
    best = {rate: max(points[i]["goodput_rps"] for points in doc["sweep"].values()) for i, rate in enumerate(rates)}
    rows = []
    for name, points in sorted(doc["sweep"].items(), key=lambda kv: -kv[1][0]["goodput_rps"]):
        goodput = " / ".join(f"{p['goodput_rps']:.1f}" for p in points)
        if all(p["goodput_rps"] == best[p["rate"]] for p in points):
            goodput = f"**{goodput}**"
        at_top = points[-1]
        rows.append([LOAD_2X_LABELS.get(name, name), goodput, f"{at_top['ttft_ms']['p50']:,.0f} ms",
                     f"{whole(at_top['itl_ms']['p99'])} ms",
                     " / ".join(f"{predicted[(name, p['rate'])]:.1f}" for p in points)])
    per = " / ".join(f"{r:g}" for r in rates)
    header = ["deployment", f"goodput at {per} per s", f"TTFT median at {top:g} /s", f"ITL p99 at {top:g} /s",
              f"predicted goodput ({doc['prediction']['commit']})"]
    prediction = doc["prediction"]
    return (caption(about(doc, file), f"the prediction: {prediction['date'][:10]}, commit {prediction['commit']}, "
                    f"{link(prediction['file'].rsplit('/', 1)[-1])}") + "\n\n" + table(header, rows))


def placement_2xh200() -> str:
    """Fresh prompts prefilled on the decode GPU (local) or the prefill server (remote), idle and busy."""
    file = "placement-2xh200.json"
    doc = load(file)
    at = {(r["busy"], r["prompt_tokens"], r["mode"]): r for r in doc["rows"]}
    rows = []

    def pair(busy: bool, n: int, key: str) -> str:
        return " / ".join(whole(at[(busy, n, mode)][key]) for mode in ("colocated", "disaggregated")) + " ms"
    for n in sorted({r["prompt_tokens"] for r in doc["rows"]}):
        rows.append([f"{n:,}", pair(False, n, "ttft_ms_p50"), pair(True, n, "ttft_ms_p50"),
                     pair(True, n, "stall_ms_p50")])
    busy = next(r["background_users"] for r in doc["rows"] if r["busy"])
    header = ["uncached tokens", "idle: local / remote TTFT", "busy: local / remote TTFT",
              "busy: the others' longest gap, local / remote"]
    return caption(about(doc, file), f"medians; busy: {busy} users decoding") + "\n\n" + table(header, rows)


ONE_TURN_LABELS = {"split": "split (1 prefill + 1 decode GPU)", "colocated": "colocated (2 GPUs)",
                   "chunked-512": "chunked 512 (2 GPUs)", "chunked-2048": "chunked 2,048 (2 GPUs)",
                   "layered": "layered (2 GPUs)"}


def load_2xh200_one_turn() -> str:
    """The one-turn load on two H200s: the split pair against one decode server per GPU."""
    file = "load-2xh200.json"
    run = run_at(file, "6813e74")
    rows = [[ONE_TURN_LABELS.get(name, name), *load_cells(r)] for name, r in run["runs"].items()]
    header = ["deployment", "requests", "ITL median", "ITL p99", "ITL max", "TTFT median", "long prompts' TTFT median",
              slo(run["params"])]
    return caption(about(run, file, "(its `previous`)")) + "\n\n" + table(header, rows)


def load_split_2xh200() -> str:
    """The split pair alone under the same load, by KV transport and commit: the handoff's set-up calls."""
    file = "load-split-2xh200.json"
    doc = load(file)
    rows = []
    for kv in ("cuda-ipc", "nccl"):
        for run in (r for r in doc["runs"] if r["kv_transport"] == kv):
            split = run["runs"]["split"]
            server = split["server_mean_ms"]
            rows.append([run["commit"], kv, str(split["completed"]), f"{whole(split['itl_ms']['p99'])} ms",
                         f"{whole(split['itl_ms']['max'])} ms", f"{split['ttft_ms']['p50']:,.0f} ms",
                         f"{whole(server['prefill_queue_s'])} ms", f"{whole(server['kv_transfer_s'])} ms",
                         f"{split['goodput_rps']:.2f} req/s"])
    header = ["commit", "transport", "requests", "ITL p99", "ITL max", "TTFT median", "prefill server's queue",
              "handoff beyond the prefill", "goodput"]
    dates = sorted(r["date"][:10] for r in doc["runs"])
    return (caption(f"{doc['hardware']}, {dates[0]}, commits {doc['commit']}, each run's command in "
                    f"{link(file)}", "the prefill server's queue and the handoff: the decode server's means")
            + "\n\n" + table(header, rows))
