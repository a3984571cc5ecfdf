"""Runs the Python and shell examples of README.md and docs/**/*.md, so an example that breaks fails CI.

The conventions a page follows (tests/test_doc_examples.py runs one test per page):

- Fenced blocks (``` or ~~~, indented inside list items or admonitions or not; the fence's indentation is
  removed) whose info string's first word is ``python``, ``sh`` or ``bash`` run. Every other block must
  say a language of ``NOT_RUN``; a block without a language, ``console`` or any other language fails
  the page, named by file:line, so an example cannot hide by being mislabelled.
- All python blocks of a page run in order in ONE Python process, in one namespace (``__name__`` is
  ``"__main__"``): later blocks use names earlier ones made. Shell blocks run each in its own
  ``bash -euo pipefail -c``, in page order between them.
- Directives: ``<!-- example: WORDS -->`` on the line(s) directly before a block (no blank line between):
  ``background`` (a shell block starting a server with an explicit ``--port N``: run in the background;
  the page goes on once the port answers ``GET /health``, ``/v1/models`` or ``/`` with 200, within 120 s or the
  block's timeout; stopped, SIGTERM then SIGKILL, at the page's end or when a later background block
  with the same port starts), ``installs`` (lines ``scripts/install.sh [test] && REST``: the installs are
  CI's; REST is run, ``.venv/bin/`` meaning this interpreter's bin folder, unless it is the test-suite
  command, which must instead appear verbatim, install and all, in ``.ci/run``), ``timeout N``
  (seconds, default 180). Any other word, or a directive not directly before a block, fails the page.
- ``<!-- example-hub: ORG/NAME=KIND ... -->`` anywhere on a page: before it runs, an offline Hugging Face
  hub cache (a fresh ``HF_HOME``) gets a tiny random model (2 layers, hidden 64, 4096 positions, the
  tests' trained 384-token BPE tokenizer) of KIND under ORG/NAME: ``llama`` and ``qwen3`` (safetensors
  folders), ``llama-gguf`` (one Q8_0 GGUF file holding its tokenizer, named ``NAME-Q4_K_M.gguf``
  with a trailing ``-GGUF`` dropped from NAME, so ``ORG/NAME`` and ``ORG/NAME:Q4_K_M`` both load it;
  ``llama-gguf:TAG`` names it ``NAME-TAG.gguf``). Every page gets a fresh, offline ``HF_HOME`` (empty
  without this comment), so no example depends on what this machine has downloaded.
- Ports: each of ``8000`` to ``8009`` (as a whole number) in every block of a page becomes a free port
  picked for the page, the same one wherever it appears, so examples say ``localhost:8000`` (and a second
  server ``8001``) and pages never collide.
- Each page runs in a fresh temporary folder holding symlinks to the repo's top-level folders and files
  (``LINKED``): ``benchmarks/x.py`` resolves, and what an example writes lands in the temp folder.
  PATH starts with this interpreter's bin folder (``pagedllm`` and ``python`` are the venv's),
  ``PYTHONUNBUFFERED=1``, ``HF_HUB_OFFLINE=1``.
- Safety: a block that is not an ``installs`` block and calls ``scripts/install.sh`` or ``-m pytest``
  fails without running (the suite must never install or run itself).

``python tests/doc_examples.py PAGE.md ...`` runs pages by hand.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

RUN = {"python", "sh", "bash"}
NOT_RUN = {"json", "jsonl", "text", "yaml", "toml", "jinja", "ebnf", "http", "mermaid", "ini", "csv", "diff",
           "html", "markdown", "cpp"}
DIRECTIVES = ("background", "installs", "timeout N")
HUB_KINDS = ("llama", "qwen3", "llama-gguf")  # llama-gguf:TAG too (the tag its file is named by)
LINKED = ("benchmarks", "scripts", "docs", "pagedllm", "tests", "README.md", "pyproject.toml", ".ci")
DEFAULT_TIMEOUT = 180.0
SERVER_START_TIMEOUT = 120.0
SUITE_COMMAND = ".venv/bin/python -m pytest"
TAIL_LINES = 60

_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>.*)$")
_COMMENT = re.compile(r"^[ \t]*<!--(?P<body>.*?)-->[ \t]*$")
_PORT_FLAG = re.compile(r"--port[ =](\d+)")
_INSTALL_LINE = re.compile(r"scripts/install\.sh(?: test)? && (?P<rest>.+)")
_HUB_ENTRY = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)=(?P<kind>\S+)")


class ExampleFailure(AssertionError):
    """A page's examples failed (or the page breaks a convention); the message says where and why."""


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    flags: list[str] = field(default_factory=list)  # background, installs
    timeout: float | None = None  # seconds the directive gave

    @property
    def runs(self) -> bool:
        return self.lang in RUN


@dataclass
class Page:
    path: Path
    blocks: list[Block]
    hub: dict[str, str]
    errors: list[str]  # convention breaches, each "file:line: why"

    @property
    def runnable(self) -> bool:
        return any(b.runs for b in self.blocks)


def parse_page(path: Path, name: str | None = None) -> Page:
    """The page's blocks, hub models and convention breaches (named ``name``:line, default the path)."""
    name = name or str(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    hub: dict[str, str] = {}
    errors: list[str] = []
    used_comments: set[int] = set()
    outside: list[int] = []  # indices of lines outside code blocks: where directives may stand
    i = 0
    while i < len(lines):
        match = _OPEN.match(lines[i])
        info = match["info"] if match else ""
        if match is None or (match["fence"][0] == "`" and "`" in info):
            outside.append(i)
            i += 1
            continue
        fence, indent = match["fence"], len(match["indent"])
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        glued = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]+\S")
        body, j = [], i + 1
        while j < len(lines) and not close.match(lines[j]):
            if glued.match(lines[j]):
                # CommonMark and superfences: a fence followed by text does not close the block.
                errors.append(f"{name}:{j + 1}: text after a closing fence: it does not close the block")
            body.append(_strip_indent(lines[j], indent))
            j += 1
        if j == len(lines):
            errors.append(f"{name}:{i + 1}: the code block is never closed")
        words = _directives(lines, i, used_comments)
        blocks.append(_block(name, i + 1, info, "\n".join(body), words, errors))
        i = j + 1
    for k in outside:
        comment = _COMMENT.match(lines[k])
        body = comment["body"].strip() if comment else ""
        if body.startswith("example-hub:"):
            _parse_hub(name, k + 1, body.removeprefix("example-hub:"), hub, errors)
        elif body.startswith("example:"):
            if k not in used_comments:
                errors.append(f"{name}:{k + 1}: directive {body!r} is not on the line(s) directly before a code block")
        elif body.startswith("example") or (comment is None and re.match(r"[ \t]*<!--\s*example", lines[k])):
            errors.append(f"{name}:{k + 1}: malformed directive {lines[k].strip()!r}: write "
                          "<!-- example: WORDS --> or <!-- example-hub: ORG/NAME=KIND --> on one line")
    return Page(path, blocks, hub, errors)


def _strip_indent(line: str, indent: int) -> str:
    """The line without up to ``indent`` leading whitespace characters (the fence's indentation)."""
    n = 0
    while n < indent and n < len(line) and line[n] in " \t":
        n += 1
    return line[n:]


def _directives(lines: list[str], fence: int, used: set[int]) -> list[str]:
    """The words of the ``example:`` comments on the lines directly above the fence."""
    words: list[str] = []
    k = fence - 1
    while k >= 0 and (comment := _COMMENT.match(lines[k])):
        body = comment["body"].strip()
        if body.startswith("example:"):
            words = body.removeprefix("example:").split() + words
            used.add(k)
        k -= 1
    return words


def _block(name: str, line: int, info: str, text: str, words: list[str], errors: list[str]) -> Block:
    lang = info.split()[0].lower() if info.split() else ""
    block = Block(line, lang, textwrap.dedent(text))
    where = f"{name}:{line}"
    if lang == "console":
        errors.append(f"{where}: 'console' blocks are not allowed: use sh for commands (they run), text for output")
    elif lang not in RUN | NOT_RUN:
        label = f"language {lang!r}" if lang else "no language"
        errors.append(f"{where}: code block with {label}: say python, sh or bash (run) or one of "
                      f"{', '.join(sorted(NOT_RUN))} (not run)")
    rest = iter(words)
    for word in rest:
        if word == "timeout":
            seconds = next(rest, "")
            if not re.fullmatch(r"\d+(\.\d*)?", seconds) or float(seconds) <= 0:
                errors.append(f"{where}: 'timeout' takes a positive number of seconds, not {seconds!r}")
            else:
                block.timeout = float(seconds)
        elif word not in ("background", "installs"):
            errors.append(f"{where}: unknown example directive {word!r}; valid: {', '.join(DIRECTIVES)}")
        elif lang not in ("sh", "bash"):
            errors.append(f"{where}: '{word}' applies to sh / bash blocks only")
        else:
            block.flags.append(word)
    if "background" in block.flags and not _PORT_FLAG.search(block.text):
        errors.append(f"{where}: a background block must say its port (--port N)")
    if "background" in block.flags and "installs" in block.flags:
        errors.append(f"{where}: a block is background or installs, not both")
    if block.runs and "installs" not in block.flags and re.search(r"scripts/install\.sh|-m pytest", block.text):
        errors.append(f"{where}: installs and the test suite never run inside the suite: mark the block "
                      "<!-- example: installs --> (lines 'scripts/install.sh [test] && REST')")
    return block


def _parse_hub(name: str, line: int, spec: str, hub: dict[str, str], errors: list[str]) -> None:
    for entry in spec.split():
        match = _HUB_ENTRY.fullmatch(entry)
        kind = match["kind"] if match else ""
        if match is None:
            errors.append(f"{name}:{line}: example-hub entry {entry!r} is not ORG/NAME=KIND")
        elif not (kind in HUB_KINDS or re.fullmatch(r"llama-gguf:\w+", kind)):
            errors.append(f"{name}:{line}: unknown example-hub kind {kind!r}; valid: {', '.join(HUB_KINDS)}, "
                          "llama-gguf:TAG")
        elif hub.setdefault(match["repo"], kind) != kind:
            errors.append(f"{name}:{line}: {match['repo']} is given two kinds")


# --- pages ---

ROOT = Path(__file__).resolve().parent.parent


def page_paths(root: Path = ROOT) -> list[str]:
    """README.md and every docs/**/*.md, repo-relative."""
    docs = sorted(p.relative_to(root).as_posix() for p in (root / "docs").rglob("*.md"))
    return (["README.md"] if (root / "README.md").is_file() else []) + docs


def pages_to_test(root: Path = ROOT) -> list[str]:
    """The pages with a block to run or a convention breach (a page whose only example is mislabelled
    must fail, not drop out of the suite)."""
    return [p for p in page_paths(root) if (page := parse_page(root / p, p)).runnable or page.errors]


def run_page(path: Path, root: Path = ROOT, name: str | None = None) -> None:
    """Run one page's examples; raise ExampleFailure naming the first that fails (or every breach)."""
    path = Path(path).resolve()
    if name is None:
        name = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
    page = parse_page(path, name)
    if page.errors:
        raise ExampleFailure("\n".join(page.errors))
    run = _PageRun(page, Path(root), name)
    try:
        run.run()
    finally:
        run.close()


# --- running a page ---

# The Python process of a page: exec()s each block it is sent into its own globals (those of
# __main__, so pickling what an example defines works) and answers ok or not on a second pipe; the
# block's prints and traceback go to its log. Under the __main__ guard: processes that
# multiprocessing spawns (tensor parallel ranks) import this file again and must not run the loop.
_DRIVER = r'''
import json as _json
import os as _os
import sys as _sys
import traceback as _traceback


def _main():
    commands = _os.fdopen(int(_sys.argv[1]), "r")
    results = _os.fdopen(int(_sys.argv[2]), "w")
    del _sys.argv[1:]  # the examples see a plain script's argv
    for request in commands:
        request = _json.loads(request)
        ok = True
        try:
            exec(compile(request["code"], request["file"], "exec"), globals())
        except BaseException as e:
            ok = isinstance(e, SystemExit) and e.code in (None, 0)
            if not ok:  # the traceback without this loop's frame
                _traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        _sys.stdout.flush()
        _sys.stderr.flush()
        results.write(_json.dumps(ok) + "\n")
        results.flush()


if __name__ == "__main__":
    _main()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, start: int = 0) -> str:
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    # A progress bar redraws its line after \r: keep what a terminal would show last.
    lines = [next((part for part in reversed(line.split("\r")) if part.strip()), "") for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    cut = f"[... {len(lines) - TAIL_LINES} lines cut ...]\n" if len(lines) > TAIL_LINES else ""
    return cut + "\n".join(lines[-TAIL_LINES:])


def _stop_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the process's group (it and what it started), SIGKILL what is left after ``grace`` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
    proc.poll()


def _answers(port: int) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
    # /: a server without the API, such as `pagedllm dashboard --simulate` (its / redirects to its page).
    for route in ("/health", "/v1/models", "/"):
        try:
            with opener.open(f"http://127.0.0.1:{port}{route}", timeout=5) as response:
                if response.status == 200:
                    return True
        except OSError:  # refused, reset, timed out, or an HTTP error status
            pass
    return False


class _PageRun:
    """One page's run: its temp folder, port, environment, Python process and background servers."""

    def __init__(self, page: Page, root: Path, name: str) -> None:
        self.page, self.root, self.name = page, root, name
        self.tmp = Path(tempfile.mkdtemp(prefix="doc-example-"))
        self.work = self.tmp / "work"
        self.work.mkdir()
        for entry in LINKED:
            if (root / entry).exists():
                (self.work / entry).symlink_to(root / entry)
        self.ports = {str(port): str(free_port()) for port in range(8000, 8010)}
        self.bin = os.path.dirname(sys.executable)  # not resolved: the venv's bin, not the base Python's
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
        no_proxy = ",".join(filter(None, [env.get("NO_PROXY", ""), "localhost,127.0.0.1"]))
        env.update(PATH=self.bin + os.pathsep + env.get("PATH", ""), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
                   HF_HOME=str(self.tmp / "hf"), NO_PROXY=no_proxy, no_proxy=no_proxy)
        self.env = env
        self.servers: dict[int, tuple[Block, subprocess.Popen, Path]] = {}
        self.python: subprocess.Popen | None = None
        self.python_log = self.tmp / "python.log"

    def run(self) -> None:
        (self.tmp / "hf" / "hub").mkdir(parents=True)
        if self.page.hub:
            build_hub_cache(self.tmp / "hf" / "hub", self.page.hub)
        for block in self.page.blocks:
            if not block.runs:
                continue
            text = re.sub(r"(?<!\d)800\d(?!\d)", lambda m: self.ports[m[0]], block.text)
            if block.lang == "python":
                self._python(block, text)
            elif "background" in block.flags:
                self._background(block, text)
            elif "installs" in block.flags:
                self._installs(block, text)
            else:
                self._shell(block, text, block.timeout or DEFAULT_TIMEOUT)

    def close(self) -> None:
        if self.python is not None:
            os.close(self.commands)  # the driver's loop ends, the engine shuts down
            try:
                self.python.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            _stop_group(self.python, 5.0)
            os.close(self.results)
        for port in list(self.servers):
            self._stop_server(port)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _fail(self, block: Block, why: str, log: Path | None, start: int = 0) -> None:
        parts = [f"{self.name}:{block.line}: {block.lang} block {why}", "----- block -----", block.text]
        if log is not None:
            parts += [f"----- output (last {TAIL_LINES} lines) -----", _tail(log, start)]
        for port, (server, _, server_log) in self.servers.items():
            if server_log != log:
                parts += [f"----- server of {self.name}:{server.line} on port {port} "
                          f"(last {TAIL_LINES} lines) -----", _tail(server_log)]
        raise ExampleFailure("\n".join(parts))

    def _popen(self, argv: list[str], log: Path, **kwargs) -> subprocess.Popen:
        with open(log, "ab") as out:
            # A session of its own: stopping the group stops what the example started too.
            return subprocess.Popen(argv, cwd=self.work, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, **kwargs)

    def _shell(self, block: Block, text: str, timeout: float) -> None:
        log = self.tmp / f"block-{block.line}.log"
        proc = self._popen(["bash", "-euo", "pipefail", "-c", text], log)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_group(proc, 2.0)
            self._fail(block, f"timed out after {timeout:g} s (a server? mark it <!-- example: background -->)", log)
        finally:
            _stop_group(proc, 2.0)  # what it left running in the background
        if code != 0:
            self._fail(block, f"exited with status {code}", log)

    def _installs(self, block: Block, text: str) -> None:
        ci = self.root / ".ci" / "run"
        ci_lines = ci.read_text().splitlines() if ci.is_file() else []
        executed = [line.strip() for line in ci_lines if line.strip() and not line.strip().startswith("#")]
        for line in (line.strip() for line in text.splitlines()):
            if not line or line.startswith("#"):
                continue
            match = _INSTALL_LINE.fullmatch(line)
            if match is None:
                self._fail(block, f"has a line that is not 'scripts/install.sh [test] && REST': {line!r}", None)
            elif re.search(r"-m pytest\b", match["rest"]):
                # The suite never runs itself: CI must run exactly this line.
                if not any(line in command for command in executed):
                    self._fail(block, f"says {line!r} but .ci/run does not run it", None)
            else:
                rest = re.sub(r"(?<![\w/.-])\.venv/bin/", self.bin + "/", match["rest"])
                self._shell(block, rest, block.timeout or DEFAULT_TIMEOUT)

    def _background(self, block: Block, text: str) -> None:
        port = int(_PORT_FLAG.search(text)[1])
        if port in self.servers:
            self._stop_server(port)
        log = self.tmp / f"server-{block.line}.log"
        proc = self._popen(["bash", "-euo", "pipefail", "-c", text], log)
        self.servers[port] = (block, proc, log)
        timeout = block.timeout or SERVER_START_TIMEOUT
        deadline = time.monotonic() + timeout
        while not _answers(port):
            if proc.poll() is not None:
                self._fail(block, f"exited with status {proc.returncode} before answering on port {port}", log)
            if time.monotonic() > deadline:
                self._fail(block, f"did not answer GET /health (or /v1/models or /) on port {port} within "
                                  f"{timeout:g} s", log)
            time.sleep(0.2)

    def _stop_server(self, port: int) -> None:
        _, proc, _ = self.servers.pop(port)
        _stop_group(proc, 10.0)

    def _python(self, block: Block, text: str) -> None:
        if self.python is None:
            driver = self.tmp / "driver.py"  # outside the work folder: its folder goes first on sys.path
            driver.write_text(_DRIVER)
            commands, self.commands = os.pipe()
            self.results, results = os.pipe()
            self.python = self._popen([sys.executable, str(driver), str(commands), str(results)], self.python_log,
                                      pass_fds=(commands, results))
            os.close(commands)
            os.close(results)
        start = self.python_log.stat().st_size
        # Blank lines first: the block's lines keep their page line numbers in tracebacks.
        request = {"code": "\n" * block.line + text, "file": str(self.page.path)}
        data = (json.dumps(request) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.commands, data):]
        except BrokenPipeError:
            self._fail(block, f"found the Python process ended ({self.python.wait()})", self.python_log, start)
        timeout = block.timeout or DEFAULT_TIMEOUT
        deadline, answer = time.monotonic() + timeout, b""
        while not answer.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.results], [], [], left)[0]:
                _stop_group(self.python, 2.0)
                self._fail(block, f"timed out after {timeout:g} s", self.python_log, start)
            chunk = os.read(self.results, 4096)
            if not chunk:
                code = self.python.wait()
                self._fail(block, f"ended the Python process (exit status {code})", self.python_log, start)
            answer += chunk
        if not json.loads(answer):
            self._fail(block, "raised an exception", self.python_log, start)


# --- tiny models in an offline hub cache ---

_BUILT: dict[str, Path] = {}  # kind -> folder, built once per process


def build_hub_cache(cache_dir: Path, hub: dict[str, str]) -> None:
    """Put a tiny random model of each kind under its repo id in the hub cache ``cache_dir``."""
    _tests_importable()
    from test_hub import add_to_cache

    for repo, kind in hub.items():
        base, _, tag = kind.partition(":")
        folder = _built(base)
        if base == "llama-gguf":
            # One file, named as GGUF repos name theirs, so ORG/NAME and ORG/NAME:TAG both pick it.
            stem = re.sub(r"-gguf$", "", repo.split("/")[1], flags=re.IGNORECASE)
            files = {f"{stem}-{tag or 'Q4_K_M'}.gguf": str(folder / "model.gguf")}
        else:
            files = {f.name: str(f) for f in folder.iterdir() if f.is_file()}
        add_to_cache(str(cache_dir), repo, files)


def _tests_importable() -> None:
    tests = str(Path(__file__).resolve().parent)
    if tests not in sys.path:
        sys.path.insert(0, tests)


def _built(kind: str) -> Path:
    if kind not in _BUILT:
        folder = Path(tempfile.mkdtemp(prefix=f"doc-example-{kind}-"))
        atexit.register(shutil.rmtree, folder, True)
        _build_model(kind, folder)
        _BUILT[kind] = folder
    return _BUILT[kind]


def _build_model(kind: str, folder: Path) -> None:
    """A 2-layer random model with the tests' trained BPE tokenizer: an HF folder (llama, qwen3) or a
    Q8_0 GGUF file holding its tokenizer (llama-gguf: ``folder/model.gguf``)."""
    import torch
    import transformers
    from conftest import train_tokenizer

    tokenizer = train_tokenizer(str(folder))
    if kind == "qwen3":  # the tags Qwen3's reasoning and tool parsers look for
        tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>", "<tool_call>",
                                                                    "</tool_call>"]})
        tokenizer.save_pretrained(str(folder))
    # 4096 positions: room for the prompts and max_tokens examples ask for.
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.2,
                  bos_token_id=1, eos_token_id=2, pad_token_id=3)
    if kind == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, tie_word_embeddings=True, **common)
    else:
        config = transformers.LlamaConfig(tie_word_embeddings=False, **common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if kind == "llama-gguf":
        from gguf_families import write_family_gguf

        write_family_gguf(model, tokenizer, "llama", str(folder / "model.gguf"), weight_type="Q8_0")
    else:
        model.save_pretrained(str(folder))


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        try:
            run_page(Path(arg))
        except ExampleFailure as failure:
            sys.exit(f"{failure}\n{arg}: FAILED")
        print(f"{arg}: ok")
