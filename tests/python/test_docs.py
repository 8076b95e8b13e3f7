"""The documentation against the code.

- The `--json` keys documented in docs/serving.md (`kda simulate`) and docs/performance.md (`kda bench`)
  are the keys the binary emits: a key either side gains or loses fails a test. `kda simulate` runs on
  the vendored tiny model checkpoint in every documented condition (a second or less each). `kda bench` has no
  small shapes: `--only gemm` (about 20 s) runs by default, the other sections (minutes each) when
  KDA_TEST_BENCH_SECTIONS names them (e.g. `all,kernels,layer,stack,spec,model`); without it, every documented
  bench key must still occur as a string literal in the sources.
- Every relative link of README.md and docs/*.md resolves: the file exists, and a `#anchor` into a
  Markdown file names one of its headings.
"""

import json
import os
import pathlib
import re
import subprocess

import kda_paths
import pytest

REPO = kda_paths.REPO
DOCS = REPO / "docs"
MINI = kda_paths.DUMPS / "mini"
# The whole model's vendored checkpoint (4 decoder layers: 3 KDA, then MLA): kda simulate serves it.
TINY_MODEL = REPO / "tests" / "data" / "model_dumps" / "tiny"


def documented_keys(page, table):
    """{key: condition} from the table between `<!-- table -->` and `<!-- /table -->` in docs/page:
    rows whose first cell is one backticked key, the condition the second cell."""
    text = (DOCS / page).read_text(encoding="utf-8")
    m = re.search(rf"<!-- {table} -->\n(.*?)<!-- /{table} -->", text, re.S)
    assert m, f"docs/{page} has no <!-- {table} --> ... <!-- /{table} --> table"
    rows = {}
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        key = re.fullmatch(r"`([^`]+)`", cells[0])
        if key is None:
            continue
        assert len(cells) >= 3, f"docs/{page}: row of {key.group(1)} lacks its condition or meaning"
        assert key.group(1) not in rows, f"docs/{page}: {key.group(1)} listed twice"
        rows[key.group(1)] = cells[1]
    assert rows, f"docs/{page}: the {table} table lists no keys"
    return rows


def run_json(*args):
    assert kda_paths.BINARY.exists(), f"{kda_paths.BINARY} not built (KDA_BINARY)"
    p = subprocess.run([str(kda_paths.BINARY), *args], capture_output=True, text=True, check=False)
    assert p.returncode == 0, f"kda {' '.join(args)} exited {p.returncode}: {p.stderr[-2000:]}"
    return json.loads(p.stdout)


def compare(emitted, expected, what):
    not_documented = sorted(set(emitted) - set(expected))
    not_emitted = sorted(set(expected) - set(emitted))
    assert not (not_documented or not_emitted), (
        f"{what}: emitted but not documented (in this condition): {not_documented}; "
        f"documented but not emitted: {not_emitted}"
    )


# kda simulate --json: the table's conditions, as predicates over the run's options.
SIMULATE_CONDITIONS = {
    "always": lambda run: True,
    "`--check` > 0": lambda run: run["check"],
    "`--speculative`": lambda run: run["spec"] is not None,
    "`--speculative replay`": lambda run: run["spec"] == "replay",
    "an accounting failure": lambda run: False,  # every run here must pass its accounting
}

SIMULATE_RUNS = {
    "plain": {"check": True, "spec": None},
    "no self-check": {"check": False, "spec": None},
    "ngram": {"check": False, "spec": "ngram"},
    "replay": {"check": True, "spec": "replay"},
}


@pytest.mark.parametrize("name", list(SIMULATE_RUNS))
def test_simulate_json_keys_are_the_documented_ones(name):
    run = SIMULATE_RUNS[name]
    doc = documented_keys("serving.md", "simulate-json-keys")
    unknown = {k: c for k, c in doc.items() if c not in SIMULATE_CONDITIONS}
    assert not unknown, f"docs/serving.md: conditions the test does not know: {unknown}"
    args = ["simulate", "--model", str(TINY_MODEL), "--requests", "3", "--prompt-len", "4:12", "--output-len", "4"]
    args += ["--check", "1" if run["check"] else "0", "--json"]
    if run["spec"]:  # its first 3 (KDA) layers: a shorter run with the same keys
        args += ["--speculative", run["spec"], "--layers", "3"]
    out = run_json(*args)
    expected = {k for k, c in doc.items() if SIMULATE_CONDITIONS[c](run)}
    compare(out.keys(), expected, f"kda {' '.join(args)}")


# kda bench --json: nested keys as paths, `a.b` for an object's member and `a[].b` for a member of an
# array's rows (the union over its rows).
BENCH_SECTIONS = ("all", "kernels", "layer", "stack", "gemm", "spec", "model", "tokenizer", "sampling", "serve", "cache", "qdecode")


def key_paths(obj, prefix=""):
    paths = set()
    for k, v in obj.items():
        path = prefix + k
        paths.add(path)
        if isinstance(v, dict):
            paths |= key_paths(v, path + ".")
        elif isinstance(v, list):
            for row in v:
                if isinstance(row, dict):
                    paths |= key_paths(row, path + "[].")
    return paths


# The qualifiers a key's sections may carry: the CPU flags it needs and those it must not have.
BENCH_QUALIFIERS = {
    "": ((), ()),
    "AVX-512 CPUs": (("avx512f",), ()),
    # oneDNN's bf16 matmul on vdpbf16ps: with AMX it runs on tiles, whose sums the kernel does not match.
    "AVX512_BF16 CPUs without AMX": (("avx512_bf16",), ("amx_bf16",)),
}


def bench_condition(cell):
    """'all, kernels; AVX-512 CPUs' -> ({'all', 'kernels'}, 'AVX-512 CPUs')."""
    sections, _, qualifier = cell.partition(";")
    names = {s.strip().strip("`") for s in sections.split(",")}
    assert names <= set(BENCH_SECTIONS), f"docs/performance.md: unknown --only sections {names}"
    assert qualifier.strip() in BENCH_QUALIFIERS, f"docs/performance.md: unknown qualifier {qualifier}"
    return names, qualifier.strip()


def cpu_flags():
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def cpu_meets(qualifier, flags):
    needs, excludes = BENCH_QUALIFIERS[qualifier]
    return all(f in flags for f in needs) and not any(f in flags for f in excludes)


def bench_sections_to_run():
    extra = os.environ.get("KDA_TEST_BENCH_SECTIONS", "")
    return ["gemm"] + [s.strip() for s in extra.split(",") if s.strip() and s.strip() != "gemm"]


@pytest.mark.parametrize("section", BENCH_SECTIONS)
def test_bench_json_keys_are_the_documented_ones(section):
    if section not in bench_sections_to_run():
        pytest.skip(f"kda bench --only {section} takes minutes: KDA_TEST_BENCH_SECTIONS={section} runs it")
    doc = {k: bench_condition(c) for k, c in documented_keys("performance.md", "bench-json-keys").items()}
    out = run_json("bench", "--only", section, "--skip-naive", "--weights", "bf16", "--json")
    flags = cpu_flags()
    expected = {k for k, (sections, needs) in doc.items() if section in sections and cpu_meets(needs, flags)}
    compare(key_paths(out), expected, f"kda bench --only {section} --json")


def test_every_documented_bench_key_occurs_in_the_sources():
    doc = documented_keys("performance.md", "bench-json-keys")
    sources = "".join(
        p.read_text(encoding="utf-8", errors="replace")
        for d in ("src", "bench")
        for p in sorted((REPO / d).rglob("*"))
        if p.suffix in (".cc", ".h")
    )
    missing = sorted({k for k in doc for name in [re.split(r"\[\]\.|\.", k)[-1]] if f'"{name}"' not in sources})
    assert not missing, f"documented kda bench keys no source file names: {missing}"


# Links.
def markdown_files():
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def strip_code(text):
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def heading_anchors(path):
    """GitHub's anchors: the heading lowercased, punctuation dropped, spaces as '-', '-n' on repeats."""
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    anchors, seen = set(), {}
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def relative_links(path):
    text = strip_code(path.read_text(encoding="utf-8"))
    for target in re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text):
        if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # not http:, https:, mailto:
            yield target


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no {dest})")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(REPO)})")
    assert not broken, f"{path.relative_to(REPO)}: broken links: {broken}"


def test_the_docs_pages_exist_and_the_readme_is_short():
    for page in ("serving", "performance", "perf-log", "quantization", "python", "cpp-api", "internals",
                 "thread-safety", "reliability"):
        assert (DOCS / f"{page}.md").is_file(), f"docs/{page}.md missing"
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines (at most 300)"
