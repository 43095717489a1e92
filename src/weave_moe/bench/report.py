"""Result files of a benchmark run: JSON (everything), CSV (one row per measurement), markdown and pictures.

    <out>/<name>.json          {"metadata": {...}, "config": {...}, "rows": [...]}; rows keep per-call times and plans
    <out>/<name>.csv           CSV_COLUMNS, one row per (model, tokens_per_rank, routing, variant)
    <out>/<name>.md            summary: geomean speed-up vs nccl and % of floor per variant, the speed-up table, errors
    <out>/<name>_latency.png   per-layer latency bars: rows = routing, columns = models, groups = tokens per rank,
                               bars = variants, black ticks = the physical floor (like the paper's Figure 10, row 1)
    <out>/<name>_speedup.png   speed-up vs nccl per configuration and variant, last row the geomean

Only matplotlib's Agg backend is used, so this works on machines without a display.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections import defaultdict

__all__ = ["CSV_COLUMNS", "BASELINE", "result_paths", "write_all", "write_tables", "write_csv", "merge", "rewrite", "load", "load_rows", "add_speedups",
           "geomean", "summary", "markdown", "plot_latency", "plot_speedups", "e2e_rows", "load_attention", "E2E_COLUMNS"]

#: The speed-up table's baseline variant.
BASELINE = "nccl"

CSV_COLUMNS = (
    "model", "tokens_per_rank", "routing", "skew", "variant", "backend", "policy", "world_size", "iters",
    "median_ms", "p10_ms", "p90_ms", "min_ms", "mean_ms", "tflops", "nvlink_gbps",
    "floor_ms", "floor_compute_ms", "floor_comm_ms", "floor_bound", "pct_of_floor", "x_floor", "speedup_vs_nccl",
    "floor_weights_ms", "x_floor_weights",
    "c", "K", "n_steal", "predicted_ms", "prediction_error_pct", "rel_error", "max_norm_error", "check_passed",
    "stages_ms", "error",
    "num_experts", "top_k", "hidden_size", "intermediate_size",
)


def result_paths(config_or_out, name: str | None = None) -> dict[str, str]:
    """Paths of every result file, from a BenchConfig or (out_dir, name)."""
    out_dir = config_or_out if name is not None else config_or_out.out_dir
    name = name if name is not None else config_or_out.name
    base = os.path.join(out_dir, name)
    return dict(json=base + ".json", csv=base + ".csv", md=base + ".md", latency_png=base + "_latency.png",
                speedup_png=base + "_speedup.png", e2e_csv=base + "_e2e.csv")


def write_all(rows: list[dict], config, partial: bool = False, world_size: int | None = None,
              attention: list | None = None) -> dict[str, str]:
    """Write every result file for `rows`; `partial` marks a run still in progress. Returns the paths."""
    paths, metadata = write_tables(rows, config, partial, world_size, attention)
    with open(paths["md"], "w") as handle:
        handle.write(markdown(rows, metadata, paths, attention))
    plot_latency(rows, paths["latency_png"])
    plot_speedups(rows, paths["speedup_png"])
    return paths


def write_tables(rows: list[dict], config, partial: bool = False, world_size: int | None = None,
                 attention: list | None = None):
    """Only the JSON and the CSVs (cheap: written after every variant). Returns (paths, metadata)."""
    from weave_moe.bench.harness import config_to_dict

    paths = result_paths(config)
    os.makedirs(config.out_dir, exist_ok=True)
    add_speedups(rows)
    metadata = dict(config.metadata, partial=partial, world_size=world_size, floor_constants=config.floor.to_dict())
    data = dict(metadata=metadata, config=config_to_dict(config), rows=rows)
    if attention:
        data["attention"] = attention
    with open(paths["json"], "w") as handle:
        json.dump(data, handle, indent=1, default=_json_default, allow_nan=True)
    write_csv(rows, paths["csv"])
    if attention:
        write_csv(e2e_rows(rows, attention), paths["e2e_csv"], E2E_COLUMNS)
    return paths, metadata


def merge(json_paths: list[str], out_dir: str, name: str) -> dict[str, str]:
    """One result set from several runs (e.g. a suite split over device calls): rows and attention timings
    concatenated in order, the first run's metadata with every source listed. Writes every file; returns the paths."""
    rows, attention, sources, configs = [], [], [], []
    metadata = {}
    for path in json_paths:
        with open(path) as handle:
            data = json.load(handle)
        metadata = metadata or dict(data.get("metadata", {}))
        sources.append(dict(path=os.path.basename(path), **{k: data.get("metadata", {}).get(k)
                                                            for k in ("date", "git_commit", "command", "partial")}))
        rows += data.get("rows", [])
        attention += data.get("attention", [])
        configs.append(data.get("config", {}))
    metadata.update(name=name, partial=any(s["partial"] for s in sources), merged_from=sources)
    paths = result_paths(out_dir, name)
    os.makedirs(out_dir, exist_ok=True)
    add_speedups(rows)
    data = dict(metadata=metadata, config=configs, rows=rows)
    if attention:
        data["attention"] = attention
    with open(paths["json"], "w") as handle:
        json.dump(data, handle, indent=1, default=_json_default, allow_nan=True)
    rewrite(paths["json"])
    return paths


def rewrite(json_path: str) -> dict[str, str]:
    """Rewrite the CSVs, markdown and pictures beside a result JSON from its contents. Returns the paths."""
    metadata, rows = load(json_path)
    attention = load_attention(json_path)
    out_dir, name = os.path.dirname(json_path) or ".", os.path.splitext(os.path.basename(json_path))[0]
    paths = result_paths(out_dir, name)
    write_csv(rows, paths["csv"])
    if attention:
        write_csv(e2e_rows(rows, attention), paths["e2e_csv"], E2E_COLUMNS)
    with open(paths["md"], "w") as handle:
        handle.write(markdown(rows, metadata, paths, attention))
    plot_latency(rows, paths["latency_png"])
    plot_speedups(rows, paths["speedup_png"])
    return paths


def _json_default(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def write_csv(rows: list[dict], path: str, columns=CSV_COLUMNS) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: _csv_value(row.get(key)) for key in columns})


def _csv_value(value):
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def load(path: str) -> tuple[dict, list[dict]]:
    """(metadata, rows) of a JSON result file."""
    with open(path) as handle:
        data = json.load(handle)
    return data.get("metadata", {}), data.get("rows", [])


def load_attention(path: str) -> list[dict]:
    """The attention timings of a JSON result file ([] when the run had no --attention)."""
    with open(path) as handle:
        return json.load(handle).get("attention", [])


def load_rows(path: str) -> list[dict]:
    return load(path)[1] if os.path.exists(path) else []


#: Columns of <name>_e2e.csv (written with --attention).
E2E_COLUMNS = ("model", "tokens_per_rank", "routing", "variant", "attention_ms", "shared_ms", "moe_ms", "e2e_ms",
               "moe_share", "e2e_speedup_vs_nccl", "moe_speedup_vs_nccl", "attention_approximate")


# --------------------------------------------------------------------------------------------------------------------
# speed-ups


def _key(row: dict) -> tuple:
    return row["model"], row["tokens_per_rank"], row["routing"]


def _ok(row: dict) -> bool:
    return not row.get("error") and row.get("median_ms") is not None


def add_speedups(rows: list[dict]) -> None:
    """Set row["speedup_vs_nccl"] = nccl median / this median, same (model, tokens, routing); None without a pair."""
    baseline = {_key(r): r["median_ms"] for r in rows if r["variant"] == BASELINE and _ok(r)}
    for row in rows:
        base = baseline.get(_key(row))
        row["speedup_vs_nccl"] = base / row["median_ms"] if base and _ok(row) else None


def geomean(values) -> float | None:
    values = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _variants(rows: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for row in rows:
        seen.setdefault(row["variant"], None)
    return list(seen)


def summary(rows: list[dict]) -> list[dict]:
    """Per variant: configurations measured / failed, checks passed, geomean speed-up vs nccl (all, uniform,
    skewed), geomean median / floor."""
    add_speedups(rows)
    table = []
    for variant in _variants(rows):
        mine = [r for r in rows if r["variant"] == variant]
        measured = [r for r in mine if _ok(r)]
        checked = [r for r in mine if r.get("check_passed") is not None]
        table.append(dict(
            variant=variant, configs=len(mine), failed=len(mine) - len(measured),
            checks=f"{sum(bool(r['check_passed']) for r in checked)}/{len(checked)}" if checked else "-",
            speedup=geomean(r.get("speedup_vs_nccl") for r in measured),
            speedup_uniform=geomean(r.get("speedup_vs_nccl") for r in measured if r["routing"] == "uniform"),
            speedup_skewed=geomean(r.get("speedup_vs_nccl") for r in measured if r["routing"] == "skewed"),
            x_floor=geomean(r.get("x_floor") for r in measured),
            x_floor_weights=geomean(r.get("x_floor_weights") for r in measured),
        ))
    return table


def e2e_rows(rows: list[dict], attention: list[dict]) -> list[dict]:
    """Per measured row: attention + shared experts + MoE = one layer's estimate, and its speed-up vs nccl."""
    add_speedups(rows)
    timed = {(a["model"], a["tokens_per_rank"]): a for a in attention or [] if a.get("attention_ms") is not None}
    found = []
    for row in rows:
        extra = timed.get((row["model"], row["tokens_per_rank"]))
        if extra is None or not _ok(row):
            continue
        dense_ms = extra["attention_ms"] + (extra.get("shared_ms") or 0.0)
        found.append(dict(model=row["model"], tokens_per_rank=row["tokens_per_rank"], routing=row["routing"],
                          variant=row["variant"], attention_ms=extra["attention_ms"], shared_ms=extra.get("shared_ms"),
                          moe_ms=row["median_ms"], e2e_ms=dense_ms + row["median_ms"],
                          moe_share=row["median_ms"] / (dense_ms + row["median_ms"]),
                          moe_speedup_vs_nccl=row.get("speedup_vs_nccl"),
                          attention_approximate=bool(extra.get("attention", {}).get("approximate"))))
    baseline = {(r["model"], r["tokens_per_rank"], r["routing"]): r["e2e_ms"] for r in found if r["variant"] == BASELINE}
    for r in found:
        base = baseline.get((r["model"], r["tokens_per_rank"], r["routing"]))
        r["e2e_speedup_vs_nccl"] = base / r["e2e_ms"] if base else None
    return found


def _e2e_markdown(rows: list[dict], attention: list[dict]) -> list[str]:
    table = e2e_rows(rows, attention)
    if not table:
        return []
    lines = ["", "## End-to-end estimate per layer (attention + shared experts + MoE)", "",
             "Attention and shared experts timed on each GPU with the model's shapes (bench/attention.py); "
             "* = approximate attention shape.", "",
             "| model | tokens | attention ms | shared ms | " + " | ".join(
                 f"{v} e2e" for v in _variants(rows)) + " |",
             "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in _variants(rows)) + " |"]
    seen = set()
    for r in table:
        key = (r["model"], r["tokens_per_rank"], r["routing"])
        if key in seen:
            continue
        seen.add(key)
        cells = []
        for variant in _variants(rows):
            match = next((x for x in table if (x["model"], x["tokens_per_rank"], x["routing"]) == key
                          and x["variant"] == variant), None)
            if match is None:
                cells.append("err")
            elif variant == BASELINE:
                cells.append(f"{match['e2e_ms']:.4g} ms")
            else:
                cells.append(_fmt(match["e2e_speedup_vs_nccl"]) + "x")
        star = "*" if r["attention_approximate"] else ""
        lines.append(f"| {r['model']}{star} | {r['tokens_per_rank']} {r['routing']} | {r['attention_ms']:.4g} | "
                     f"{_fmt(r['shared_ms'], '.4g')} | " + " | ".join(cells) + " |")
    geomeans = [_fmt(geomean(x["e2e_speedup_vs_nccl"] for x in table if x["variant"] == v)) for v in _variants(rows)]
    lines.append("| **geomean** | | | | " + " | ".join(f"**{g}**" for g in geomeans) + " |")
    return lines


def _fmt(value, spec=".2f", missing="-") -> str:
    return missing if value is None else format(value, spec)


def markdown(rows: list[dict], metadata: dict, paths: dict | None = None, attention: list | None = None) -> str:
    """The summary, the speed-up table (with geomeans), the end-to-end estimate and the errors, as markdown."""
    add_speedups(rows)
    lines = [f"# Benchmark {metadata.get('name', '')}".rstrip(), ""]
    if metadata.get("partial"):
        lines += ["**Partial: the run was still going when this was written.**", ""]
    for label, key in (("date", "date"), ("device", "device"), ("world size", "world_size"),
                       ("commit", "git_commit"), ("torch / triton", "versions"), ("command", "command")):
        if key in metadata:
            value = metadata[key]
            if isinstance(value, dict):
                value = ", ".join(f"{k} {v}" for k, v in value.items())
            lines.append(f"- {label}: `{value}`")
    floor = metadata.get("floor_constants")
    if floor:
        lines.append(f"- floor: {floor['gemm_tflops']} TFLOP/s GEMM, {floor['peer_gbps']} GB/s per direction "
                     f"({floor['source']})")
        if floor.get("hbm_gbps"):
            lines.append(f"- weights bound (reported beside the floor): expert weights read once at "
                         f"{floor['hbm_gbps']} GB/s HBM (the H200's specified bandwidth)")
    with_weights = any(s.get("x_floor_weights") for s in summary(rows))
    lines += ["", "## Per variant (geomean over configurations)", "",
              "| variant | configs | failed | checks | speed-up vs nccl | uniform | skewed | median / floor |"
              + (" median / max(floor, weights) |" if with_weights else ""),
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if with_weights else "")]
    for s in summary(rows):
        lines.append(f"| {s['variant']} | {s['configs']} | {s['failed']} | {s['checks']} | "
                     f"{_fmt(s['speedup'])} | {_fmt(s['speedup_uniform'])} | {_fmt(s['speedup_skewed'])} | "
                     f"{_fmt(s['x_floor'])} |" + (f" {_fmt(s['x_floor_weights'])} |" if with_weights else ""))
    variants = _variants(rows)
    lines += ["", "## Speed-up vs nccl (nccl column: its median, ms; floor column: ms)", "",
              "| model | tokens | routing | floor | " + " | ".join(variants) + " |",
              "| --- | ---: | --- | ---: | " + " | ".join("---:" for _ in variants) + " |"]
    by_key = defaultdict(dict)
    for row in rows:
        by_key[_key(row)][row["variant"]] = row
    for key, cells in by_key.items():
        floor_ms = next(iter(cells.values())).get("floor_ms")
        values = []
        for variant in variants:
            row = cells.get(variant)
            if row is None or not _ok(row):
                values.append("err" if row is not None else "")
            elif variant == BASELINE:
                values.append(f"{row['median_ms']:.4g} ms")
            else:
                values.append(_fmt(row.get("speedup_vs_nccl"), ".2f") + "x")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {_fmt(floor_ms, '.4g')} | " + " | ".join(values) + " |")
    geomeans = [_fmt(geomean(r.get("speedup_vs_nccl") for r in rows if r["variant"] == v and _ok(r)), ".2f")
                for v in variants]
    lines.append("| **geomean** | | | | " + " | ".join(f"**{g}**" for g in geomeans) + " |")
    lines += _e2e_markdown(rows, attention or [])
    errors = [r for r in rows if r.get("error")]
    if errors:
        lines += ["", "## Errors", ""]
        seen = set()
        for row in errors:
            if (row["model"], row["variant"], row["error"]) in seen:
                continue
            seen.add((row["model"], row["variant"], row["error"]))
            lines.append(f"- {row['model']} / {row['variant']}: `{row['error']}`")
    failed_checks = [r for r in rows if r.get("check_passed") is False]
    if failed_checks:
        lines += ["", "## Failed checks", ""]
        for row in failed_checks:
            lines.append(f"- {row['model']} {row['tokens_per_rank']} {row['routing']} / {row['variant']}: "
                         f"rel error {row['rel_error']:.3e}")
    if paths:
        lines += ["", f"![latency]({os.path.basename(paths['latency_png'])})",
                  f"![speed-up]({os.path.basename(paths['speedup_png'])})"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------------------------
# pictures


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency(rows: list[dict], path: str) -> None:
    """Grouped bars of per-layer latency (ms): one panel per (routing, model), groups = tokens, bars = variants."""
    plt = _pyplot()
    models = list(dict.fromkeys(r["model"] for r in rows))
    routings = list(dict.fromkeys(r["routing"] for r in rows))
    variants = _variants(rows)
    if not models:
        return
    legend_in = 1.9  # a column at the right for the legend, whatever the number of variants
    width_in = 3.4 * len(models) + 0.6 + legend_in
    figure, axes = plt.subplots(len(routings), len(models), figsize=(width_in, 3.0 * len(routings) + 0.3),
                                squeeze=False)
    colors = plt.get_cmap("tab10")
    width = 0.8 / max(1, len(variants))
    for i, routing in enumerate(routings):
        for j, model in enumerate(models):
            ax = axes[i][j]
            mine = [r for r in rows if r["model"] == model and r["routing"] == routing]
            tokens = sorted({r["tokens_per_rank"] for r in mine})
            for v, variant in enumerate(variants):
                heights = []
                for t in tokens:
                    row = next((r for r in mine if r["variant"] == variant and r["tokens_per_rank"] == t), None)
                    heights.append(row["median_ms"] if row is not None and _ok(row) else 0.0)
                positions = [g + (v - (len(variants) - 1) / 2) * width for g in range(len(tokens))]
                ax.bar(positions, heights, width, color=colors(v % 10), label=variant if i == j == 0 else None)
                for position, height in zip(positions, heights):
                    if height == 0.0:  # failed or missing: a cross where the bar would stand
                        ax.plot(position, 0.02, marker="x", color=colors(v % 10), transform=ax.get_xaxis_transform())
            for g, t in enumerate(tokens):
                floor_ms = next((r["floor_ms"] for r in mine if r["tokens_per_rank"] == t), None)
                if floor_ms:
                    ax.hlines(floor_ms, g - 0.45, g + 0.45, colors="black", linewidth=1.5,
                              label="floor" if i == j == g == 0 else None)
            measured = [r["median_ms"] for r in mine if _ok(r)] + [r["floor_ms"] for r in mine if r.get("floor_ms")]
            if measured and min(measured) > 0 and max(measured) / min(measured) > 30:
                ax.set_yscale("log")  # decode and prefill sizes in one panel: linear bars would hide the small ones
            ax.set_xticks(range(len(tokens)))
            ax.set_xticklabels([str(t) for t in tokens])
            ax.set_title(f"{model} ({routing})", fontsize=9)
            ax.tick_params(labelsize=8)
            if j == 0:
                ax.set_ylabel("layer latency (ms)")
            if i == len(routings) - 1:
                ax.set_xlabel("tokens per rank")
    figure.legend(loc="center right", fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0, 1 - legend_in / width_in, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_speedups(rows: list[dict], path: str) -> None:
    """A table picture: speed-up vs nccl per configuration (rows) and variant (columns), geomean last."""
    plt = _pyplot()
    add_speedups(rows)
    variants = [v for v in _variants(rows) if v != BASELINE] or _variants(rows)
    keys = list(dict.fromkeys(_key(r) for r in rows))
    if not keys or not variants:
        return
    cells = {(_key(r), r["variant"]): r.get("speedup_vs_nccl") for r in rows}
    values = [[cells.get((key, v)) for v in variants] for key in keys]
    values.append([geomean(cells.get((key, v)) for key in keys) for v in variants])
    labels = [f"{m} {t} {r}" for m, t, r in keys] + ["geomean"]
    figure, ax = plt.subplots(figsize=(1.3 * len(variants) + 3.0, 0.28 * len(labels) + 1.2))
    grid = [[math.log2(v) if v else float("nan") for v in line] for line in values]
    ax.imshow(grid, cmap="RdYlGn", vmin=-1.5, vmax=1.5, aspect="auto")
    for i, line in enumerate(values):
        for j, value in enumerate(line):
            text = "err" if value is None else f"{value:.2f}"
            ax.text(j, i, text, ha="center", va="center", fontsize=7,
                    fontweight="bold" if i == len(values) - 1 else "normal")
    ax.set_xticks(range(len(variants)))
    ax.set_xticklabels(variants, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_title("speed-up vs nccl (median latency ratio)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
