"""The overlap figure: a step with the exchange after backprop and overlapped with it, on the emulated
network, beside compute alone and communication alone."""

from __future__ import annotations

from pathlib import Path

from rdkeras.bench.figures.common import Section, Target, fmt_ms, load_note, markdown_table, pyplot, save_png


def plot(ov: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    names = [
        "compute alone",
        "communication alone",
        "allreduce, after backprop",
        "allreduce, overlapped",
        "PS, after backprop",
        "PS, overlapped",
    ]
    keys = [
        "compute_s",
        "comm_s",
        "allreduce_sequential_s",
        "allreduce_overlapped_s",
        "ps_sequential_s",
        "ps_overlapped_s",
    ]
    vals = [ov[k] * 1e3 for k in keys]
    ax.barh(names[::-1], vals[::-1], color=["0.6", "0.6", "tab:red", "tab:blue", "tab:red", "tab:blue"][::-1])
    ax.axvline(ov["max_s"] * 1e3, color="k", ls=":", lw=1, label="max(compute, communication)")
    ax.axvline(ov["sum_s"] * 1e3, color="tab:red", ls=":", lw=1, label="compute + communication")
    ax.set_xlabel("ms per step")
    ax.set_title(f"Overlap on the emulated network\ntcp over a {ov['rate']} veth link, {ov['model']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)  # off the bars
    save_png(fig, path)


def table(ov: dict) -> list[str]:
    """Each configuration's step against max(compute, comm) and their sum; per mode, where the overlapped
    exchange's time went."""
    rows: list[list[str | None]] = [
        ["compute alone", f"{ov['compute_s'] * 1e3:.0f}", None, None],
        ["communication alone (the same bucketed allreduces)", f"{ov['comm_s'] * 1e3:.0f}", None, None],
    ]
    for mode in ("allreduce", "ps"):
        for label in ("sequential", "overlapped"):
            v = ov[f"{mode}_{label}_s"]
            step = f"{mode}, {'exchange after backprop' if label == 'sequential' else 'overlapped'}"
            rows.append([step, f"{v * 1e3:.0f}", f"{v / ov['max_s']:.2f}", f"{v / ov['sum_s']:.2f}"])
    lines = markdown_table([None, "ms per step", "÷ max(compute, comm)", "÷ (compute + comm)"], rows)
    for mode in ("allreduce", "ps"):
        b = ov.get(f"{mode}_breakdown") or {}
        if b:
            lines.append(
                f"\n{mode}, overlapped, per step (medians, rank 0): the buckets' communication took "
                f"{b['comm_work_s'] * 1e3:.0f} ms end to end; the first bucket was handed over "
                f"{b['first_start_to_wait_s'] * 1e3:.0f} ms before backprop ended (the wait op began); "
                f"{b['hidden_s'] * 1e3:.0f} ms of communication had finished by then, and the wait op "
                f"blocked {b['exposed_s'] * 1e3:.0f} ms."
            )
    return lines


def why_overlap(ov: dict) -> list[str]:
    """The overlapped step as compute alone, time blocked on the last buckets, and the rest: backprop slower
    beside the communication than alone."""
    b = ov.get("allreduce_breakdown") or {}
    step, compute = ov["allreduce_overlapped_s"], ov["compute_s"]
    if "exposed_s" not in b:
        return []
    slowed = step - compute - b["exposed_s"]
    return [
        f"the overlapped step {fmt_ms(step)} = compute alone {fmt_ms(compute)} + {fmt_ms(b['exposed_s'])} blocked "
        f"on the last buckets after backprop + {fmt_ms(slowed)} of backprop running slower beside the communication "
        f"than alone (its {fmt_ms(b['comm_work_s'])} of bucket exchanges, {fmt_ms(b['hidden_s'])} of them done "
        f"before backprop ended, share the cores); max(compute, comm) = {fmt_ms(ov['max_s'])}, comm alone "
        f"{fmt_ms(ov['comm_s'])}, the exchange after backprop {fmt_ms(ov['allreduce_sequential_s'])}."
    ]


def render(results: dict, out: Path) -> Section:
    """The section (and overlap.png) where overlap was measured or skipped; its target: within 1.2x of
    max(compute, comm)."""
    ov = results.get("overlap")
    if not ov:
        return [], []
    lines = ["## Communication overlapping backprop", ""]
    if "skipped" in ov or "error" in ov:
        return [*lines, f"Not measured: {ov.get('skipped') or ov.get('error')}"], []
    plot(ov, out / "overlap.png")
    lines += [
        f"Two workers in two network namespaces, tcp over a veth pair capped at {ov['rate']} (tc tbf; "
        f"delay: {ov.get('delay') or 'none'}), {ov['model']} with batch {ov['per_worker_batch']} per "
        f"worker, {ov['buckets']} gradient buckets. " + load_note(results, "overlap"),
        "",
        *table(ov),
        "",
        "![Overlap](overlap.png)",
        "",
    ]
    x = ov["allreduce_overlapped_x_max"]
    target = Target("overlap (allreduce) within 1.2× of max(compute, comm)", x <= 1.2, f"{x:.2f}×", why_overlap(ov))
    return lines, [target]
