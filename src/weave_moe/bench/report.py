"""Result files of a benchmark run: JSON (everything), CSV (one row per measurement), markdown and pictures.

    <out>/<name>.json              {"metadata": {...}, "config": {...}, "rows": [...]}; rows keep per-call times, plans
    <out>/<name>.csv               CSV_COLUMNS, one row per (model, tokens_per_rank, routing, variant)
    <out>/<name>.md                the standing (geomeans vs the best baseline, each baseline and the floor, per token
                                   band), the per-configuration table, skipped variants, errors
    <out>/<name>_latency.png       per-layer latency bars: rows = routing, columns = models, groups = tokens per rank,
                                   bars = variants, black ticks = the physical floor, grey = the library compute anchor
    <out>/<name>_vs_baseline.png   median / best baseline median per configuration and variant, geomean rows last
    <out>/<name>_e2e.csv           with --attention: the end-to-end estimate per row

Ranking: per configuration (model, tokens per rank, routing) the best baseline is the fastest of the baselines
(`variants.BASELINES`: nccl, symm, deepep) that ran and did not fail its check. Every row gets `x_best_baseline` =
its median / that median (< 1 = faster than every baseline), `x_<baseline>` against each baseline, `x_floor` and
`x_lib_compute`. Summaries are geomeans of those ratios over configurations, per token band (<= 1024 and > 1024
tokens per rank: decode and prefill sizes), never mixed into one number.

Only matplotlib's Agg backend is used, so this works on machines without a display.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections import defaultdict

from weave_moe.bench.config import config_to_dict
from weave_moe.bench.variants import BASELINES

__all__ = ["CSV_COLUMNS", "E2E_COLUMNS", "result_paths", "unique_name", "write_all", "write_tables", "write_csv",
           "merge", "combine_parts", "rewrite", "load", "load_rows", "load_attention", "add_rankings", "geomean",
           "token_bands", "summary", "library_standing", "failed_rows", "markdown", "plot_latency", "plot_vs_baseline", "e2e_rows"]

CSV_COLUMNS = (
    "model", "tokens_per_rank", "routing", "skew", "variant", "backend", "policy", "world_size", "emulate_ep",
    "iters", "timing", "median_ms", "p10_ms", "p90_ms", "min_ms", "mean_ms", "tflops", "nvlink_gbps",
    "best_baseline", "best_baseline_ms", "x_best_baseline", *(f"x_{b}" for b in BASELINES),
    "floor_ms", "x_floor", "pct_of_floor", "floor_bound", "floor_compute_ms", "floor_comm_ms", "floor_weights_ms",
    "lib_compute_ms", "x_lib_compute",
    "c", "K", "n_steal", "predicted_ms", "prediction_error_pct", "rel_error", "max_norm_error", "check_passed",
    "stages_ms", "skipped", "error",
    "num_experts", "num_local_experts", "top_k", "hidden_size", "intermediate_size",
)

#: Columns of <name>_e2e.csv (written with --attention).
E2E_COLUMNS = ("model", "tokens_per_rank", "routing", "variant", "attention_ms", "shared_ms", "moe_ms", "e2e_ms",
               "moe_share", "x_best_baseline_e2e", "x_best_baseline", "attention_approximate")

#: Token bands of the summary: decode sizes (<= this many tokens per rank) and prefill sizes (above it).
BAND_SPLIT_TOKENS = 1024


def result_paths(config_or_out, name: str | None = None) -> dict[str, str]:
    """Paths of every result file, from a BenchConfig or (out_dir, name)."""
    out_dir = config_or_out if name is not None else config_or_out.out_dir
    name = name if name is not None else config_or_out.name
    base = os.path.join(out_dir, name)
    return dict(json=base + ".json", csv=base + ".csv", md=base + ".md", latency_png=base + "_latency.png",
                vs_baseline_png=base + "_vs_baseline.png", e2e_csv=base + "_e2e.csv")


def unique_name(out_dir: str, name: str) -> str:
    """`name`, or `name-2`, `name-3`, ... : the first whose result files do not exist yet in `out_dir` (a rerun on
    the same day keeps the earlier results)."""
    candidate, number = name, 1
    while any(os.path.exists(path) for path in result_paths(out_dir, candidate).values()):
        number += 1
        candidate = f"{name}-{number}"
    return candidate


def write_all(rows: list[dict], config, partial: bool = False, world_size: int | None = None,
              attention: list | None = None) -> dict[str, str]:
    """Write every result file for `rows`; `partial` marks a run still in progress. Returns the paths."""
    paths, metadata = write_tables(rows, config, partial, world_size, attention)
    with open(paths["md"], "w") as handle:
        handle.write(markdown(rows, metadata, paths, attention))
    plot_latency(rows, paths["latency_png"])
    plot_vs_baseline(rows, paths["vs_baseline_png"])
    return paths


def write_tables(rows: list[dict], config, partial: bool = False, world_size: int | None = None,
                 attention: list | None = None):
    """Only the JSON and the CSVs (cheap: written after every variant). Returns (paths, metadata)."""
    paths = result_paths(config)
    os.makedirs(config.out_dir, exist_ok=True)
    add_rankings(rows)
    metadata = dict(config.metadata, partial=partial, world_size=world_size, emulate_ep=config.emulate_ep,
                    max_tokens_per_rank=config.layer_max_tokens, floor_constants=config.floor.to_dict())
    data = dict(metadata=metadata, config=config_to_dict(config), rows=rows)
    if attention:
        data["attention"] = attention
    _dump(data, paths["json"])
    write_csv(rows, paths["csv"])
    if attention:
        write_csv(e2e_rows(rows, attention), paths["e2e_csv"], E2E_COLUMNS)
    return paths, metadata


def _dump(data: dict, path: str) -> None:
    with open(path, "w") as handle:
        json.dump(data, handle, indent=1, default=_json_default, allow_nan=True)


def combine_parts(part_paths: list[str], config, world_size: int) -> list[dict]:
    """The result files of one run whose variants ran in several sets of ranks (own-process backends): the parts'
    rows in the config's model and variant order, the library compute anchor (measured by the first part) copied to
    every row of its configuration, written under `config.name`; the part files are removed. Returns the rows."""
    rows, attention, partial = [], [], False
    for path in part_paths:
        if not os.path.exists(path):
            partial = True  # that part died before writing anything
            continue
        with open(path) as handle:
            data = json.load(handle)
        rows += data.get("rows", [])
        attention += data.get("attention", [])
        partial = partial or bool(data.get("metadata", {}).get("partial"))
    model_order = {spec.name: i for i, spec in enumerate(config.models)}
    variant_order = {v.name: i for i, v in enumerate(config.variants)}
    rows.sort(key=lambda r: (model_order.get(r["model"], len(model_order)), variant_order.get(r["variant"], 0)))
    anchors = {_key(r): r["lib_compute_ms"] for r in rows if r.get("lib_compute_ms")}
    for row in rows:
        anchor = anchors.get(_key(row))
        if anchor and not row.get("lib_compute_ms"):
            row["lib_compute_ms"] = anchor
            row["x_lib_compute"] = row["median_ms"] / anchor if _ok(row) else None
    write_all(rows, config, partial=partial, world_size=world_size, attention=attention)
    for path in part_paths:
        for part_file in result_paths(os.path.dirname(path) or ".", os.path.basename(path)[:-5]).values():
            if os.path.exists(part_file):
                os.remove(part_file)
    return rows


def merge(json_paths: list[str], out_dir: str, name: str) -> dict[str, str]:
    """One result set from several runs (e.g. a suite split over device calls): rows and attention timings
    concatenated in order, the first run's metadata with every source listed. Writes every file under a name not
    taken yet (`unique_name`); returns the paths."""
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
    name = unique_name(out_dir, name)
    metadata.update(name=name, partial=any(s["partial"] for s in sources), merged_from=sources)
    paths = result_paths(out_dir, name)
    os.makedirs(out_dir, exist_ok=True)
    add_rankings(rows)
    data = dict(metadata=metadata, config=configs, rows=rows)
    if attention:
        data["attention"] = attention
    _dump(data, paths["json"])
    rewrite(paths["json"])
    return paths


def rewrite(json_path: str) -> dict[str, str]:
    """Rewrite the CSVs, markdown and pictures beside a result JSON from its contents. Returns the paths."""
    metadata, rows = load(json_path)
    attention = load_attention(json_path)
    out_dir, name = os.path.dirname(json_path) or ".", os.path.splitext(os.path.basename(json_path))[0]
    paths = result_paths(out_dir, name)
    add_rankings(rows)
    write_csv(rows, paths["csv"])
    if attention:
        write_csv(e2e_rows(rows, attention), paths["e2e_csv"], E2E_COLUMNS)
    with open(paths["md"], "w") as handle:
        handle.write(markdown(rows, metadata, paths, attention))
    plot_latency(rows, paths["latency_png"])
    plot_vs_baseline(rows, paths["vs_baseline_png"])
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


# --------------------------------------------------------------------------------------------------------------------
# ranking


def _key(row: dict) -> tuple:
    return row["model"], row["tokens_per_rank"], row["routing"]


def _ok(row: dict) -> bool:
    """The row has a time (it ran, did not fail, was not skipped)."""
    return not row.get("error") and not row.get("skipped") and row.get("median_ms") is not None


def _backend(row: dict) -> str:
    return row.get("backend") or row["variant"].partition(":")[0]


def add_rankings(rows: list[dict]) -> None:
    """Set, on every row, `best_baseline` / `best_baseline_ms` (the fastest baseline of its configuration that ran
    and did not fail its check; None when there is none), `x_best_baseline` = median / best_baseline_ms and
    `x_<baseline>` = median / that baseline's median (None where either is missing)."""
    baseline_ms: dict[tuple, dict[str, float]] = defaultdict(dict)
    for row in rows:
        backend = _backend(row)
        if backend in BASELINES and row["variant"] == backend and _ok(row) and row.get("check_passed") is not False:
            baseline_ms[_key(row)][backend] = row["median_ms"]
    for row in rows:
        times = baseline_ms.get(_key(row), {})
        best = min(times, key=lambda b: (times[b], BASELINES.index(b))) if times else None
        row["best_baseline"] = best
        row["best_baseline_ms"] = times[best] if best else None
        measured = _ok(row)
        row["x_best_baseline"] = row["median_ms"] / times[best] if best and measured else None
        for baseline in BASELINES:
            row[f"x_{baseline}"] = row["median_ms"] / times[baseline] if baseline in times and measured else None


def geomean(values) -> float | None:
    values = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def token_bands(rows: list[dict]) -> list[tuple[str, int, int]]:
    """[(label, lowest, highest tokens per rank)] of the bands present: decode sizes (<= BAND_SPLIT_TOKENS) and
    prefill sizes (above), labelled by the token counts the rows hold, e.g. "128-512"."""
    bands = []
    for low, high in ((1, BAND_SPLIT_TOKENS), (BAND_SPLIT_TOKENS + 1, math.inf)):
        present = sorted({r["tokens_per_rank"] for r in rows if low <= r["tokens_per_rank"] <= high})
        if present:
            label = f"{present[0]}-{present[-1]}" if len(present) > 1 else str(present[0])
            bands.append((label, present[0], present[-1]))
    return bands


def _variants(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(row["variant"] for row in rows))


def _baselines_present(rows: list[dict]) -> list[str]:
    return [b for b in BASELINES if any(r.get(f"x_{b}") is not None for r in rows)]


def summary(rows: list[dict]) -> list[dict]:
    """Per variant and token band: configurations, failed / skipped counts, checks passed, and the geomeans of
    x_best_baseline, x_<baseline> for each baseline and x_floor over the band's measured configurations."""
    add_rankings(rows)
    table = []
    for label, low, high in token_bands(rows):
        band = [r for r in rows if low <= r["tokens_per_rank"] <= high]
        for variant in _variants(band):
            mine = [r for r in band if r["variant"] == variant]
            measured = [r for r in mine if _ok(r)]
            checked = [r for r in mine if r.get("check_passed") is not None]
            entry = dict(
                variant=variant, tokens=label, configs=len(mine),
                failed=sum(1 for r in mine if r.get("error")), skipped=sum(1 for r in mine if r.get("skipped")),
                checks=f"{sum(bool(r['check_passed']) for r in checked)}/{len(checked)}" if checked else "-",
                x_best_baseline=geomean(r.get("x_best_baseline") for r in measured),
                x_floor=geomean(r.get("x_floor") for r in measured),
            )
            for baseline in BASELINES:
                entry[f"x_{baseline}"] = geomean(r.get(f"x_{baseline}") for r in measured)
            table.append(entry)
    return table


def library_standing(rows: list[dict]) -> list[dict]:
    """Per token band, the fastest weave variant of each configuration against the library compute anchor
    (`lib_compute_ms`: `torch._grouped_mm` GEMM0 + SiLU-mul + GEMM1 on the same groups, no communication): how many
    configurations are at or under it, the geomean of the ratios and the worst one. Only rows that ran and did not
    fail a check count; configurations without an anchor or a weave row are left out. [dict(tokens, configs,
    at_or_under, geomean, worst=(model, tokens per rank, routing, ratio))], bands without any left out."""
    table = []
    for label, low, high in token_bands(rows):
        best: dict[tuple, float] = {}
        for row in rows:
            if not (low <= row["tokens_per_rank"] <= high) or _backend(row) != "weave" or not _ok(row) \
                    or row.get("check_passed") is False or not row.get("lib_compute_ms"):
                continue
            ratio = row["median_ms"] / row["lib_compute_ms"]
            best[_key(row)] = min(ratio, best.get(_key(row), math.inf))
        if best:
            worst = max(best, key=best.get)
            table.append(dict(tokens=label, configs=len(best), at_or_under=sum(r <= 1.0 for r in best.values()),
                              geomean=geomean(best.values()), worst=(*worst, best[worst])))
    return table


def failed_rows(rows: list[dict]) -> list[dict]:
    """Rows that make the run fail: an error (not a skip), or a --check that did not pass."""
    return [r for r in rows if r.get("error") or r.get("check_passed") is False]


def e2e_rows(rows: list[dict], attention: list[dict]) -> list[dict]:
    """Per measured row: attention + shared experts + MoE = one layer's estimate, and its ratio to the best
    baseline's estimate (`x_best_baseline_e2e`, < 1 = faster)."""
    add_rankings(rows)
    timed = {(a["model"], a["tokens_per_rank"]): a for a in attention or [] if a.get("attention_ms") is not None}
    found = []
    for row in rows:
        extra = timed.get((row["model"], row["tokens_per_rank"]))
        if extra is None or not _ok(row):
            continue
        dense_ms = extra["attention_ms"] + (extra.get("shared_ms") or 0.0)
        best_ms = row.get("best_baseline_ms")
        found.append(dict(model=row["model"], tokens_per_rank=row["tokens_per_rank"], routing=row["routing"],
                          variant=row["variant"], attention_ms=extra["attention_ms"], shared_ms=extra.get("shared_ms"),
                          moe_ms=row["median_ms"], e2e_ms=dense_ms + row["median_ms"],
                          moe_share=row["median_ms"] / (dense_ms + row["median_ms"]),
                          x_best_baseline=row.get("x_best_baseline"),
                          x_best_baseline_e2e=(dense_ms + row["median_ms"]) / (dense_ms + best_ms) if best_ms else None,
                          attention_approximate=bool(extra.get("attention", {}).get("approximate"))))
    return found


def _fmt(value, spec=".2f", missing="-") -> str:
    return missing if value is None else format(value, spec)


# --------------------------------------------------------------------------------------------------------------------
# markdown


def markdown(rows: list[dict], metadata: dict, paths: dict | None = None, attention: list | None = None) -> str:
    """The standing per token band, the per-configuration table (with geomeans), the end-to-end estimate, skipped
    variants, errors and failed checks, as markdown."""
    add_rankings(rows)
    emulate_ep = metadata.get("emulate_ep") or 1
    title = f"# Benchmark {metadata.get('name', '')}".rstrip()
    if emulate_ep > 1:
        title += f" (emulated EP={emulate_ep} on one GPU)"
    lines = [title, ""]
    if metadata.get("partial"):
        lines += ["**Partial: the run was still going when this was written.**", ""]
    if emulate_ep > 1:
        lines += [f"Every backend ran at EP=1 on the per-rank work of EP={emulate_ep}: E/{emulate_ep} local experts, "
                  f"T x k pairs per rank, no NVLink traffic (docs/benchmarking.md, 'Single GPU'). The floor has no "
                  f"communication term here.", ""]
    for label, key in (("date", "date"), ("device", "device"), ("world size", "world_size"),
                       ("layers' max_tokens_per_rank", "max_tokens_per_rank"), ("commit", "git_commit"), ("torch / triton", "versions"), ("command", "command")):
        if key in metadata:
            value = metadata[key]
            if isinstance(value, dict):
                value = ", ".join(f"{k} {v}" for k, v in value.items())
            lines.append(f"- {label}: `{value}`")
    floor = metadata.get("floor_constants")
    if floor:
        # results written before the weights term joined the floor have no HBM rate
        weights = (f", hit experts' weights read once at {floor['hbm_gbps']:g} GB/s HBM" if floor.get("hbm_gbps")
                   else "")
        lines.append(f"- floor = max(FLOPs at {floor['gemm_tflops']:g} TFLOP/s, deduplicated NVLink bytes at "
                     f"{floor['peer_gbps']:g} GB/s per direction{weights}) ({floor['source']})")
    graphed = sorted({r["variant"] for r in rows if r.get("timing") == "graph"})
    if graphed:
        eager = sorted({r["variant"] for r in rows if r.get("timing") == "eager"})
        lines.append(f"- timing: each call a replay of the call captured in a CUDA graph (as serving engines run "
                     f"decode) for {', '.join(graphed)}; eager calls for {', '.join(eager) or 'none'}")
    if any(r.get("lib_compute_ms") for r in rows):
        lines.append("- lib compute: `torch._grouped_mm` GEMM0 + SiLU-mul + GEMM1 on the same per-rank groups, no "
                     "communication, in a CUDA graph on GPUs, median (docs/benchmarking.md)")
    baselines = _baselines_present(rows)
    lines += ["", "## Standing (geomean over configurations of median ratios; < 1 = faster)", ""]
    if not baselines:
        lines += ["No baseline ran, so nothing is ranked against one.", ""]
    by_band = defaultdict(list)
    for entry in summary(rows):
        by_band[entry["tokens"]].append(entry)
    for band, entries in by_band.items():
        lines += [f"### {band} tokens per rank", "",
                  "| variant | configs | failed | skipped | checks | x best baseline | "
                  + "".join(f"x {b} | " for b in baselines) + "x floor |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | " + "---: | " * len(baselines) + "---: |"]
        for s in entries:
            lines.append(f"| {s['variant']} | {s['configs']} | {s['failed']} | {s['skipped']} | {s['checks']} | "
                         f"{_fmt(s['x_best_baseline'])} | " + "".join(f"{_fmt(s[f'x_{b}'])} | " for b in baselines)
                         + f"{_fmt(s['x_floor'])} |")
        lines.append("")
    standing = library_standing(rows)
    if standing:
        lines += ["### Against the library compute", "",
                  "The fastest weave variant of each configuration / lib compute (`torch._grouped_mm` alone):", ""]
        for s in standing:
            model, tokens, routing, ratio = s["worst"]
            lines.append(f"- {s['tokens']} tokens per rank: at or under in {s['at_or_under']} of {s['configs']}, "
                         f"geomean {_fmt(s['geomean'], '.3f')}, worst {model} {tokens} {routing} {ratio:.3f}")
        lines.append("")
    lines += _configuration_table(rows)
    lines += _e2e_markdown(rows, attention or [])
    lines += _problems(rows)
    if paths:
        lines += ["", f"![latency]({os.path.basename(paths['latency_png'])})",
                  f"![vs best baseline]({os.path.basename(paths['vs_baseline_png'])})"]
    return "\n".join(lines) + "\n"


def _configuration_table(rows: list[dict]) -> list[str]:
    variants = _variants(rows)
    lines = ["## Per configuration: median / best baseline median", "",
             "floor and lib compute in ms; best baseline: its name and median ms; err = failed, skip = skipped.", "",
             "| model | tokens | routing | floor | lib compute | best baseline | " + " | ".join(variants) + " |",
             "| --- | ---: | --- | ---: | ---: | --- | " + " | ".join("---:" for _ in variants) + " |"]
    by_key: dict[tuple, dict] = defaultdict(dict)
    for row in rows:
        by_key[_key(row)][row["variant"]] = row
    for key, cells in by_key.items():
        first = next(iter(cells.values()))
        best = first.get("best_baseline")
        best_text = f"{best} {first['best_baseline_ms']:.4g}" if best else "-"
        values = []
        for variant in variants:
            row = cells.get(variant)
            if row is None:
                values.append("")
            elif row.get("skipped"):
                values.append("skip")
            elif not _ok(row):
                values.append("err")
            else:
                values.append(_fmt(row.get("x_best_baseline")) + ("" if row.get("check_passed") is not False
                                                                  else " (check failed)"))
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {_fmt(first.get('floor_ms'), '.4g')} | "
                     f"{_fmt(first.get('lib_compute_ms'), '.4g')} | {best_text} | " + " | ".join(values) + " |")
    for label, low, high in token_bands(rows):
        geomeans = [_fmt(geomean(r.get("x_best_baseline") for r in rows if r["variant"] == v and _ok(r)
                                 and low <= r["tokens_per_rank"] <= high)) for v in variants]
        lines.append(f"| **geomean {label}** | | | | | | " + " | ".join(f"**{g}**" for g in geomeans) + " |")
    return lines


def _e2e_markdown(rows: list[dict], attention: list[dict]) -> list[str]:
    table = e2e_rows(rows, attention)
    if not table:
        return []
    variants = _variants(rows)
    lines = ["", "## End-to-end estimate per layer (attention + shared experts + MoE) / the best baseline's", "",
             "Attention and shared experts timed on each GPU with the model's shapes (bench/attention.py); "
             "* = approximate attention shape.", "",
             "| model | tokens | attention ms | shared ms | " + " | ".join(variants) + " |",
             "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in variants) + " |"]
    by_key: dict[tuple, dict] = defaultdict(dict)
    for r in table:
        by_key[r["model"], r["tokens_per_rank"], r["routing"]][r["variant"]] = r
    for key, cells in by_key.items():
        first = next(iter(cells.values()))
        values = [_fmt(cells[v]["x_best_baseline_e2e"]) if v in cells else "err" for v in variants]
        star = "*" if first["attention_approximate"] else ""
        lines.append(f"| {key[0]}{star} | {key[1]} {key[2]} | {first['attention_ms']:.4g} | "
                     f"{_fmt(first['shared_ms'], '.4g')} | " + " | ".join(values) + " |")
    geomeans = [_fmt(geomean(x["x_best_baseline_e2e"] for x in table if x["variant"] == v)) for v in variants]
    lines.append("| **geomean** | | | | " + " | ".join(f"**{g}**" for g in geomeans) + " |")
    return lines


def _problems(rows: list[dict]) -> list[str]:
    lines = []
    for title, field in (("Skipped (the backend cannot run on this machine)", "skipped"), ("Errors", "error")):
        seen = dict.fromkeys((r["model"] if field == "error" else "", r["variant"], r[field])
                             for r in rows if r.get(field))
        if seen:
            lines += ["", f"## {title}", ""]
            lines += [f"- {f'{model} / ' if model else ''}{variant}: `{message}`" for model, variant, message in seen]
    failed_checks = [r for r in rows if r.get("check_passed") is False]
    if failed_checks:
        lines += ["", "## Failed checks", ""]
        for row in failed_checks:
            lines.append(f"- {row['model']} {row['tokens_per_rank']} {row['routing']} / {row['variant']}: "
                         f"rel error {_fmt(row.get('rel_error'), '.3e')}")
    return lines


# --------------------------------------------------------------------------------------------------------------------
# pictures


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency(rows: list[dict], path: str) -> None:
    """Grouped bars of per-layer latency (ms): one panel per (routing, model), groups = tokens, bars = variants;
    black ticks = the floor, grey dashed ticks = the library compute anchor."""
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
                    if height == 0.0:  # failed, skipped or missing: a cross where the bar would stand
                        ax.plot(position, 0.02, marker="x", color=colors(v % 10), transform=ax.get_xaxis_transform())
            for g, t in enumerate(tokens):
                first = next((r for r in mine if r["tokens_per_rank"] == t), {})
                for field, style, label in (("floor_ms", dict(colors="black", linewidth=1.5), "floor"),
                                            ("lib_compute_ms", dict(colors="grey", linewidth=1.2, linestyles="dashed"),
                                             "lib compute")):
                    if first.get(field):
                        ax.hlines(first[field], g - 0.45, g + 0.45, **style,
                                  label=label if i == j == g == 0 else None)
            measured = ([r["median_ms"] for r in mine if _ok(r)] + [r["floor_ms"] for r in mine if r.get("floor_ms")])
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


def plot_vs_baseline(rows: list[dict], path: str) -> None:
    """A table picture: median / best baseline median per configuration (rows) and variant (columns), one geomean
    row per token band last; green = faster than the best baseline."""
    plt = _pyplot()
    add_rankings(rows)
    variants = _variants(rows)
    keys = list(dict.fromkeys(_key(r) for r in rows))
    if not keys or not variants:
        return
    cells = {(_key(r), r["variant"]): r.get("x_best_baseline") for r in rows}
    values = [[cells.get((key, v)) for v in variants] for key in keys]
    labels = [f"{m} {t} {r}" for m, t, r in keys]
    for label, low, high in token_bands(rows):
        values.append([geomean(cells.get((key, v)) for key in keys if low <= key[1] <= high) for v in variants])
        labels.append(f"geomean {label}")
    figure, ax = plt.subplots(figsize=(1.3 * len(variants) + 3.0, 0.28 * len(labels) + 1.2))
    grid = [[-math.log2(v) if v else float("nan") for v in line] for line in values]
    ax.imshow(grid, cmap="RdYlGn", vmin=-1.5, vmax=1.5, aspect="auto")
    for i, line in enumerate(values):
        for j, value in enumerate(line):
            text = "-" if value is None else f"{value:.2f}"
            ax.text(j, i, text, ha="center", va="center", fontsize=7,
                    fontweight="bold" if labels[i].startswith("geomean") else "normal")
    ax.set_xticks(range(len(variants)))
    ax.set_xticklabels(variants, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_title("median / best baseline median (< 1 = faster)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
