"""The documentation's reference pages (pagedllm/reference_pages) say what the code does: each page is
checked against the thing it describes, built independently here (the CLI's real parsers, the
refusal tables, a live server's /metrics, the family tables), and the MkDocs hook builds them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import subprocess
import sys
import types

import httpx
import pytest

from pagedllm.config import ENGINE_ARG_GROUPS, SERVER_ARG_GROUPS, EngineArgs
from pagedllm.entrypoints.openai import request_fields, responses_input
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.settings import ServerSettings
from pagedllm.models.families import FAMILIES
from pagedllm.models.unsupported_families import UNSUPPORTED
from pagedllm.reference_pages import PAGES, render_all
from pagedllm.reference_pages.markdown import cell
from pagedllm.serving.data_parallel import DataParallelConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOOK = ROOT / "pagedllm" / "reference_pages" / "mkdocs_hook.py"
_CELL_SPLIT = re.compile(r"(?<!\\)\|")


def sections(markdown: str) -> dict[str, list[list[str]]]:
    """``## title`` -> its table rows, each a list of cells (escaped ``\\|`` stays in its cell)."""
    found: dict[str, list[list[str]]] = {}
    title = ""
    for line in markdown.splitlines():
        if line.startswith("## "):
            title = line[3:]
            found[title] = []
        elif line.startswith("| ") and not line.startswith("|---") and title:
            found[title].append([part.strip() for part in _CELL_SPLIT.split(line)[1:-1]])
    return {title: rows[1:] for title, rows in found.items()}  # the header row off


def rows_by_first_cell(rows: list[list[str]]) -> dict[str, list[str]]:
    return {row[0].strip("`"): row for row in rows}


def option_strings(text: str) -> set[str]:
    return set(re.findall(r"`(-[^`]+)`", text))


def subparsers() -> dict[str, argparse.ArgumentParser]:
    """The `pagedllm` CLI's own subcommand parsers."""
    from pagedllm.entrypoints.cli import build_parser

    [action] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def options_of(parser: argparse.ArgumentParser, dest: str) -> set[str]:
    return {option for action in parser._actions if action.dest == dest for option in action.option_strings}


# ---------------------------------------------------------------------------- settings


@pytest.fixture(scope="module")
def settings_page() -> str:
    return PAGES["reference/settings.md"]()


def _rows_of_groups(page: str, groups: tuple[str, ...]) -> dict[str, list[str]]:
    """The rows of the sections titled after ``groups`` (ENGINE_ARG_GROUPS or SERVER_ARG_GROUPS), by setting."""
    titles = {title[0].upper() + title[1:] for title in groups}
    found: dict[str, list[str]] = {}
    for title, rows in sections(page).items():
        if title in titles:
            found.update(rows_by_first_cell(rows))
    return found


def _engine_rows(page: str) -> dict[str, list[str]]:
    return _rows_of_groups(page, ENGINE_ARG_GROUPS)


def _server_rows(page: str) -> dict[str, list[str]]:
    return _rows_of_groups(page, SERVER_ARG_GROUPS)


def test_every_engine_setting_has_the_flags_argparse_has(settings_page) -> None:
    rows = _engine_rows(settings_page)
    parsers = subparsers()
    for spec in dataclasses.fields(EngineArgs):
        assert spec.name in rows, f"EngineArgs.{spec.name} is missing from the settings page"
        for command in ("generate", "chat"):
            expected = options_of(parsers[command], spec.name)
            assert expected, f"{command} has no flag for {spec.name}"
            assert option_strings(rows[spec.name][1]) == expected, spec.name
        # serve takes every engine setting too (its --distributed-executor-backend is the data-parallel one).
        assert options_of(parsers["serve"], spec.name) >= option_strings(rows[spec.name][1]), spec.name


def test_every_server_setting_has_the_flags_argparse_has(settings_page) -> None:
    rows = _server_rows(settings_page)
    code_only = rows_by_first_cell(sections(settings_page)["Set in code only"])
    serve = subparsers()["serve"]
    for settings_class in (ServerSettings, DataParallelConfig):
        for spec in dataclasses.fields(settings_class):
            expected = options_of(serve, spec.name)
            if "group" in spec.metadata:
                assert spec.name in rows, f"{settings_class.__name__}.{spec.name} is missing"
                assert expected and option_strings(rows[spec.name][1]) == expected, spec.name
            else:
                key = f"{settings_class.__name__}.{spec.name}"
                assert key in code_only, f"{key} (no flag) is missing"
                assert not expected and code_only[key][1] == "(none)", key


def test_aliases_and_negatives_are_listed(settings_page) -> None:
    rows = {**_engine_rows(settings_page), **_server_rows(settings_page)}
    assert {"--quantization", "-q"} == option_strings(rows["quantization"][1])
    assert {"--enable-prefix-caching", "--no-enable-prefix-caching", "--no-prefix-caching"} == option_strings(
        rows["enable_prefix_caching"][1])
    assert "--disable-log-requests" in option_strings(rows["log_requests"][1])


def test_the_settings_page_follows_a_fields_help_and_default(monkeypatch) -> None:
    from pagedllm.reference_pages.settings_page import render

    for owner, name in ((EngineArgs, "max_num_seqs"), (ServerSettings, "port")):
        spec = owner.__dataclass_fields__[name]
        old_help, old_default = spec.metadata["help"], spec.default
        before = rows_by_first_cell([row for rows in sections(render()).values() for row in rows])[name]
        assert cell(old_help) in before[4] and before[3] == f"`{old_default!r}`"
        new_help = f"A changed help for {name}, to see it on the page."
        monkeypatch.setattr(spec, "metadata", types.MappingProxyType({**spec.metadata, "help": new_help}))
        monkeypatch.setattr(spec, "default", 4321)
        after = rows_by_first_cell([row for rows in sections(render()).values() for row in rows])[name]
        assert cell(new_help) in after[4] and cell(old_help) not in after[4]
        assert after[3] == "`4321`"
        monkeypatch.undo()


# ---------------------------------------------------------------------------- requests

ENDPOINTS = {
    "`POST /v1/completions`": CompletionRequest,
    "`POST /v1/chat/completions`": ChatCompletionRequest,
    "`POST /v1/embeddings`": EmbeddingRequest,
    "`POST /v1/responses`": ResponsesRequest,
    "`POST /tokenize`": TokenizeRequest,
    "`POST /detokenize`": DetokenizeRequest,
}
REFUSALS = {
    "`POST /v1/chat/completions`": {**request_fields._REFUSED_CHAT_FIELDS, **request_fields._REFUSED_SAMPLING_FIELDS},
    "`POST /v1/completions`": {**request_fields._REFUSED_COMPLETION_FIELDS,
                               **request_fields._REFUSED_SAMPLING_FIELDS},
    "`POST /v1/responses`": responses_input._REFUSED_FIELDS,
}


@pytest.fixture(scope="module")
def request_sections() -> dict[str, list[list[str]]]:
    return sections(PAGES["reference/requests.md"]())


def test_every_request_field_appears(request_sections) -> None:
    assert set(ENDPOINTS) <= set(request_sections)
    for endpoint, model in ENDPOINTS.items():
        rows = rows_by_first_cell(request_sections[endpoint])
        for name, info in model.model_fields.items():
            assert (info.alias or name) in rows, f"{endpoint}: {name} is missing"
        assert len(rows) == len(model.model_fields), f"{endpoint}: rows for fields the model lacks"


def test_every_refused_field_appears_refused_with_its_reason(request_sections) -> None:
    for endpoint, refused in REFUSALS.items():
        assert refused, endpoint
        rows = rows_by_first_cell(request_sections[endpoint])
        for name, (accepted, reason) in refused.items():
            assert rows[name][3] == "refused", f"{endpoint}: {name}"
            assert cell(reason) in rows[name][4], f"{endpoint}: {name}'s reason"
            for value in accepted:
                assert f"`{json.dumps(value)}`" in rows[name][4], f"{endpoint}: {name} accepts {value!r}"
        implemented = [row[0] for name, row in rows.items() if name not in refused and row[3] != "implemented"]
        assert not implemented, f"{endpoint}: marked refused but in no table: {implemented}"


# ---------------------------------------------------------------------------- metrics


def _scraped_names(text: str) -> set[str]:
    """Family base names as the exposition declares them (``# TYPE``): a counter's without ``_total`` (the
    TYPE line has it or not by prometheus_client's version), ``_created`` series folded into their family."""
    declared = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    bases = {name.removesuffix("_total") if kind == "counter" else name: kind for name, kind in declared.items()}
    names = set()
    for name in bases:
        base = name.removesuffix("_created")
        names.add(base if base != name and bases.get(base) in ("counter", "histogram") else name)
    return {name for name in names if name.startswith("pagedllm:")}


def _page_names(page: str) -> set[str]:
    names = set()
    for rows in sections(page).values():
        for row in rows:
            name, kind = row[0].strip("`"), row[1]
            names.add(name.removesuffix("_total") if kind == "counter" else name)
    return names


def _scrape_a_live_server(model_path: str) -> tuple[str, str]:
    """/metrics of a server on a tiny engine after one completion: as one engine, then as the data-parallel
    front end's stats (replica_frontend.get_stats' shape) with this engine as its replica."""
    from test_server import ServerThread

    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.serving.router import make_router

    # Speculation on, so the speculative decoding counters are exported too.
    args = EngineArgs(model=model_path, num_kv_blocks=64, device="cpu", dtype="float32", max_num_seqs=4,
                      num_threads=1, speculative_config={"method": "ngram"})
    engine = LLMEngine.from_engine_args(args)
    app = build_app(engine=engine, served_model_name="tiny", log_requests=False)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        done = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7, 5, 6, 7, 5, 6],
                                                   "max_tokens": 4, "temperature": 0.0, "ignore_eos": True})
        assert done.status_code == 200, done.text
        one_engine = client.get("/metrics").text
        router = make_router("prefix", block_size=4)
        router.record(router.choose(list(range(8)), {0: 0}), list(range(8)))
        real_stats = engine.get_stats
        engine.get_stats = lambda: {"replicas": {0: {**real_stats(), "requests_in_flight": 0}},
                                    "replica_live": {0: True}, "router": router.stats(), "request_retries": 0}
        return one_engine, client.get("/metrics").text


def test_the_metrics_page_names_what_a_live_server_exports(tiny_model_factory) -> None:
    from pagedllm.kernels import use_kernel_config

    # The metrics do not depend on the C++ kernels: the torch paths spare this test a kernel build.
    with use_kernel_config(cpu_kernels=False):
        one_engine, replicas = _scrape_a_live_server(tiny_model_factory("llama"))
    scraped = _scraped_names(one_engine) | _scraped_names(replicas)
    assert "pagedllm:spec_decode_num_drafts" in scraped and "pagedllm:replica_live" in scraped
    page = _page_names(PAGES["reference/metrics.md"]())
    assert scraped - page == set(), "exported but not on the page"
    assert page - scraped == set(), "on the page but not exported"


def test_the_metrics_page_gives_each_metric_its_type_and_labels() -> None:
    rows = rows_by_first_cell([row for rows in sections(PAGES["reference/metrics.md"]()).values() for row in rows])
    assert rows["pagedllm:time_to_first_token_seconds"][1] == "histogram"
    assert rows["pagedllm:request_success_total"][1] == "counter"
    assert "`finished_reason`" in rows["pagedllm:request_success_total"][2]
    assert "`replica` (replicas)" in rows["pagedllm:num_requests_running"][2]


# ---------------------------------------------------------------------------- families


def test_every_family_and_unsupported_type_appears() -> None:
    page = PAGES["reference/families.md"]()
    found = sections(page)
    served = rows_by_first_cell(next(rows for title, rows in found.items() if title.startswith("Served")))
    refused = rows_by_first_cell(next(rows for title, rows in found.items() if title.startswith("Not served")))
    for model_type, family in FAMILIES.items():
        key = f"[`{model_type}`](#{model_type})"
        assert key in served, model_type
        assert all(arch in served[key][1] for arch in family.architectures)
        assert model_type in found, f"no section for {model_type}"
    for model_type in ("gpt2", "opt", "deepseek_v3"):  # the models with classes of their own
        assert f"[`{model_type}`](#{model_type})" in served and model_type in found
    for model_type, reason in UNSUPPORTED.items():
        assert refused[model_type][1] == cell(reason), model_type
    from pagedllm.models.gguf_loader import GGUF_MODEL_TYPES

    for arch, model_type in GGUF_MODEL_TYPES.items():
        assert f"`{arch}`" in served[f"[`{model_type}`](#{model_type})"][2], arch


# ---------------------------------------------------------------------------- the MkDocs build


def test_render_all_writes_every_page_with_a_title_and_its_source() -> None:
    pages = render_all()
    assert set(pages) == set(PAGES)
    for path, markdown in pages.items():
        lines = markdown.splitlines()
        assert lines[0].startswith("# ") and lines[2].startswith("Generated from "), path
        for line in lines:  # a table row is one line: no cell may hold a newline or break the columns
            if line.startswith("|"):
                assert line.endswith("|"), (path, line)


def test_mkdocs_builds_the_pages_with_the_hook(tmp_path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n")
    nav = "\n".join(f"  - {path}" for path in PAGES)
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"site_name: test\ndocs_dir: docs\nhooks:\n  - {HOOK}\nmarkdown_extensions:\n  - tables\n"
                      f"nav:\n  - index.md\n{nav}\n")
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for path in PAGES:
        html = (site / path.removesuffix(".md") / "index.html").read_text()
        assert "<table>" in html and "<td>" in html, path
    settings_html = (site / "reference" / "settings" / "index.html").read_text()
    assert "<td><code>str | None</code></td>" in settings_html  # an escaped | stays in its cell
    assert "&lt;think&gt;" in settings_html  # help text with angle brackets is text, not a tag
    families_html = (site / "reference" / "families" / "index.html").read_text()
    assert all(f'id="{model_type}"' in families_html for model_type in FAMILIES)
