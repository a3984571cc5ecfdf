"""The examples of README.md and docs/**/*.md run (one test per page), and the runner itself
(tests/doc_examples.py) passes and fails as its conventions say, on synthetic pages."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
from doc_examples import ROOT, ExampleFailure, pages_to_test, parse_page, run_page

PAGES = pages_to_test(ROOT)  # at import: one test per page below


def test_pages_are_collected() -> None:
    """An empty page list must fail here, not leave the parametrized test below to skip silently."""
    runnable = [p for p in PAGES if parse_page(ROOT / p, p).runnable]
    assert "README.md" in runnable, PAGES
    assert len([p for p in runnable if p.startswith("docs/")]) >= 3, PAGES


@pytest.mark.parametrize("page", PAGES)
def test_page_examples(page: str) -> None:
    run_page(ROOT / page, ROOT, page)


# --- the runner on synthetic pages ---

def write_page(tmp_path: Path, text: str, name: str = "page.md") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def fails(path: Path, *expected: str, root: Path = ROOT) -> str:
    with pytest.raises(ExampleFailure) as failure:
        run_page(path, root)
    message = str(failure.value)
    for text in expected:
        assert text in message, message
    return message


def test_parser_dedents_and_keeps_line_numbers(tmp_path) -> None:
    path = write_page(tmp_path, """\
        # Title

        1. a step:

            ```python
            x = 1
            if x:
                y = 2
            ```
        ~~~~ sh title="run it"
        echo ```
        ~~~~
        ```text
        not run
        ```
        """)
    page = parse_page(path, "page.md")
    assert not page.errors
    assert [(b.line, b.lang, b.text) for b in page.blocks] == [
        (5, "python", "x = 1\nif x:\n    y = 2"), (10, "sh", "echo ```"), (13, "text", "not run")]
    assert [b.runs for b in page.blocks] == [True, True, False]


def test_passing_blocks_share_one_python_process_and_folder(tmp_path, monkeypatch) -> None:
    path = write_page(tmp_path, """\
        ```python
        answer = 41
        ```
        Prose between.
        ```python
        answer += 1
        open("answer.txt", "w").write(str(answer))
        ```
        ```bash
        test "$(cat answer.txt)" = 42 && test -d benchmarks && test "$(command -v python)" -ef "$VIRTUAL_PYTHON"
        ```
        ```json
        {"not": "run"}
        ```
        """)
    monkeypatch.setenv("VIRTUAL_PYTHON", os.path.join(os.path.dirname(sys.executable), "python"))
    run_page(path)
    path.write_text(path.read_text().replace("answer += 1", "answer += 2"))
    fails(path, "page.md:9: bash block exited with status 1")


def test_failing_python_block_names_file_and_line(tmp_path) -> None:
    path = write_page(tmp_path, """\
        # Title

        ```python
        x = 1
        ```
        ```python
        print("before")
        raise ValueError(f"boom {x}")
        ```
        ```python
        print("never")
        ```
        """)
    message = fails(path, "page.md:6: python block raised an exception", 'raise ValueError(f"boom {x}")',
                    "before", "ValueError: boom 1", f'File "{path}", line 8')
    assert "never" not in message.split("----- output")[1] and "_main" not in message


def test_failing_and_timed_out_sh_blocks(tmp_path) -> None:
    ok = write_page(tmp_path, "```sh\necho hi | grep -q hi\n```\n", "ok.md")
    run_page(ok)
    failing = write_page(tmp_path, "```sh\necho before\nfalse | cat\necho after\n```\n")
    output = fails(failing, "page.md:1: sh block exited with status 1").split("----- output")[1]
    assert "before" in output and "after" not in output
    unset = write_page(tmp_path, "```bash\necho \"$NO_SUCH_VARIABLE\"\n```\n", "unset.md")
    fails(unset, "unset.md:1: bash block exited", "NO_SUCH_VARIABLE: unbound variable")
    slow = write_page(tmp_path, "<!-- example: timeout 1 -->\n```sh\nsleep 30\n```\n", "slow.md")
    fails(slow, "slow.md:2: sh block timed out after 1 s")
    slow_python = write_page(tmp_path, "<!-- example: timeout 1 -->\n```python\nimport time\ntime.sleep(30)\n```\n",
                             "slow_python.md")
    fails(slow_python, "slow_python.md:2: python block timed out after 1 s")


def test_unlabelled_or_unknown_languages_fail(tmp_path) -> None:
    path = write_page(tmp_path, """\
        ```
        pagedllm generate hi
        ```
        ```console
        $ pagedllm generate hi
        ```
        ```py
        print(1)
        ```
        ```python
        print("ok")
        ```
        """)
    message = fails(path, "page.md:1: code block with no language", "page.md:4: 'console' blocks are not allowed",
                    "page.md:7: code block with language 'py'")
    assert "ok" not in message  # a page breaking the conventions runs nothing



def test_pages_with_examples_or_breaches_get_a_test(tmp_path) -> None:
    write_page(tmp_path, "```sh\ntrue\n```\n", "README.md")
    (tmp_path / "docs" / "guides").mkdir(parents=True)
    write_page(tmp_path, "# Prose only\n\n```text\noutput\n```\n", "docs/prose.md")
    write_page(tmp_path, "```console\n$ pagedllm generate hi\n```\n", "docs/guides/hidden.md")
    assert pages_to_test(tmp_path) == ["README.md", "docs/guides/hidden.md"]


def test_directives_must_be_known_and_directly_before_a_block(tmp_path) -> None:
    path = write_page(tmp_path, """\
        <!-- example: skip -->
        ```python
        print(1)
        ```
        <!-- example: timeout 5 -->

        ```python
        print(2)
        ```
        <!-- example: timeout soon -->
        ```sh
        true
        ```
        <!-- example: background -->
        ```sh
        sleep 1
        ```
        <!-- example: installs -->
        ```python
        print(3)
        ```
        <!-- examples: timeout 5 -->
        ```sh
        scripts/install.sh
        ```
        """)
    fails(path, "page.md:2: unknown example directive 'skip'; valid: background, installs, timeout N",
          "page.md:5: directive 'example: timeout 5' is not on the line(s) directly before a code block",
          "page.md:11: 'timeout' takes a positive number of seconds, not 'soon'",
          "page.md:15: a background block must say its port (--port N)",
          "page.md:19: 'installs' applies to sh / bash blocks only",
          "page.md:22: malformed directive", "page.md:23: installs and the test suite never run inside the suite")


def test_glued_or_unclosed_fences_fail(tmp_path) -> None:
    path = write_page(tmp_path, "```python\nprint(1)\n``` Prose glued to the fence\nmore\n")
    fails(path, "page.md:3: text after a closing fence: it does not close the block",
          "page.md:1: the code block is never closed")


SERVER = """\
```sh
cat > server.py <<'EOF'
import http.server, os, sys
name, port = sys.argv[1], int(sys.argv[sys.argv.index("--port") + 1])
open(sys.argv[2], "a").write(f"{os.getpid()}\\n")
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(name.encode())
print(f"serving {name}", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
EOF
```
"""

BACKGROUND_PAGE = SERVER + """\
<!-- example: background -->
```sh
python server.py first PIDS --port 8000
```
```sh
test "$(curl -s localhost:8000/health)" = first
```
<!-- example: background timeout 30 -->
```sh
python server.py second PIDS --port 8000
```
```python
import urllib.request
assert urllib.request.urlopen("http://127.0.0.1:8000/health").read() == b"second"
port = 8000
assert port != int("80" + "00") and 18000 == 18 * 1000  # 8000 is the page's port; 18000 stays
assert 8001 != port and 8001 != int("80" + "01")  # 8001 is the page's second port, another one
```
```sh
curl -sf localhost:8000/missing
```
"""


def test_background_server_curl_port_and_stop(tmp_path) -> None:
    pids = tmp_path / "pids"
    path = write_page(tmp_path, BACKGROUND_PAGE.replace("PIDS", str(pids)))
    message = fails(path, "page.md:33: sh block exited with status 22", "page.md:23 on port",
                    "serving second")
    assert "serving first" not in message  # the first server was stopped when the second started
    first, second = (int(pid) for pid in pids.read_text().split())
    for pid in (first, second):  # both stopped: the second at the page's end
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_background_server_that_exits_or_never_answers(tmp_path) -> None:
    exits = write_page(tmp_path, """\
        <!-- example: background -->
        ```sh
        python -c "import sys; print('bye'); sys.exit(3)" --port 8000
        ```
        """)
    fails(exits, "page.md:2: sh block exited with status 3 before answering on port", "bye")
    silent = write_page(tmp_path, "<!-- example: background timeout 1 -->\n```sh\nsleep 30  # --port 8000\n```\n",
                        "silent.md")
    fails(silent, "silent.md:2: sh block did not answer GET /health (or /v1/models or /) on port")


def test_installs_runs_the_rest_and_checks_the_suite_command_in_ci(tmp_path) -> None:
    root = tmp_path / "root"
    (root / ".ci").mkdir(parents=True)
    ran = tmp_path / "ran"
    path = write_page(root, f"""\
        <!-- example: installs -->
        ```sh
        scripts/install.sh && .venv/bin/python -c "open('{ran}', 'w').write('yes')"
        scripts/install.sh test && .venv/bin/python -m pytest
        ```
        """)
    (root / ".ci" / "run").write_text("#!/bin/sh\n# scripts/install.sh test && .venv/bin/python -m pytest\n")
    fails(path, "says 'scripts/install.sh test && .venv/bin/python -m pytest' but .ci/run does not run it", root=root)
    assert ran.read_text() == "yes"
    (root / ".ci" / "run").write_text("set -e\nscripts/install.sh test && .venv/bin/python -m pytest\n")
    run_page(path, root)
    path.write_text(path.read_text().replace("scripts/install.sh && ", "pip install . && "))
    fails(path, "has a line that is not 'scripts/install.sh [test] && REST'", root=root)


def test_example_hub_serves_tiny_models_offline(tmp_path) -> None:
    path = write_page(tmp_path, """\
        <!-- example-hub: org/tiny=llama -->
        ```python
        from pagedllm import LLM, SamplingParams
        llm = LLM(model="org/tiny", num_kv_blocks=16, block_size=8, dtype="float32")
        print(llm.generate(["hi"], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids)
        ```
        ```python
        LLM(model="org/other", num_kv_blocks=16, block_size=8, dtype="float32")
        ```
        """)
    fails(path, "page.md:7: python block raised an exception", "'org/other' is not in the hub cache")
    unknown = write_page(tmp_path, "<!-- example-hub: org/tiny=gpt7 org/x -->\n```sh\ntrue\n```\n", "unknown.md")
    fails(unknown, "unknown.md:1: unknown example-hub kind 'gpt7'; valid: llama, qwen3, llama-gguf, llama-gguf:TAG",
          "unknown.md:1: example-hub entry 'org/x' is not ORG/NAME=KIND")


def test_example_hub_qwen3_and_gguf_kinds(tmp_path) -> None:
    path = write_page(tmp_path, """\
        <!-- example-hub: org/q3=qwen3 org/tiny-GGUF=llama-gguf org/q8=llama-gguf:Q8_0 -->
        ```sh
        pagedllm models | grep org/q3
        ```
        ```python
        from pagedllm import LLM, SamplingParams
        small = dict(num_kv_blocks=16, block_size=8, dtype="float32")
        greedy = SamplingParams(max_tokens=2, temperature=0)
        for model in ("org/q3", "org/tiny-GGUF:Q4_K_M", "org/tiny-GGUF", "org/q8:q8_0"):
            print(model, LLM(model=model, **small).generate(["hi"], greedy)[0].outputs[0].token_ids)
        ```
        ```python
        LLM(model="org/tiny-GGUF:Q5_K_M", **small)
        ```
        """)
    # Line 12: the blocks before it passed, every model loaded.
    fails(path, "page.md:12: python block raised an exception", "has no .gguf file for quant 'Q5_K_M'")
