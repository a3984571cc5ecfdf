"""benchmarks/peers.py without any peer installed: workloads, agreement, the tiny tokenizer, the subprocess path."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap

import pytest
from requirements_here import require

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("peers_benchmark", os.path.join(ROOT, "benchmarks", "peers.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_workloads_are_seeded_and_in_range(peers):
    lengths = peers.sharegpt_like_lengths(64, seed=3)
    assert lengths == peers.sharegpt_like_lengths(64, seed=3)
    assert lengths != peers.sharegpt_like_lengths(64, seed=4)
    assert all(16 <= p <= 256 and 16 <= o <= 256 for p, o in lengths)
    assert len({p for p, _ in lengths}) > 20  # long-tailed, not constant
    wl = peers.make_workload("default", "/m", 49152, seed=0, num_prompts=None)
    assert len(wl.prompts) == 64 and [len(p) for p in wl.prompts] == [p for p, _ in peers.sharegpt_like_lengths(64, 0)]
    assert all(peers.TOKEN_ID_LOW <= t < 49152 for p in wl.prompts for t in p)
    tiny = peers.make_workload("tiny", "/m", 32000, seed=0, num_prompts=None)
    assert len(tiny.prompts) == 32 and {len(p) for p in tiny.prompts} == {64} and tiny.output_tokens == 32 * 128
    assert tiny.warmup(16)["max_tokens"] == [16] * 32


def test_compare_token_ids(peers):
    ref = [[1, 2, 3], [4, 5, 6]]
    assert peers.compare_token_ids(ref, [[1, 2, 3], [4, 5, 6, 7]], [3, 3]) == "identical (2/2 requests)"
    assert peers.compare_token_ids(ref, [[1, 2, 3], [4, 9, 6]], [3, 3]) == (
        "1/2 requests identical; first divergence: request 1 token 1: 5 vs 9")
    assert "request 0: 2 tokens instead of 3" in peers.compare_token_ids(ref, [[1, 2], [4, 5, 6]], [3, 3])


def test_tiny_tokenizer_sentencepiece_and_json_agree(peers, tmp_path):
    peers.save_tiny_tokenizer(str(tmp_path), 600)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 600 and len(set(tok.get_vocab())) == 600
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<unk>", "<s>", "</s>", "<0x00>"]
    spm = require("sentencepiece")
    processor = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    assert processor.get_piece_size() == 600
    assert [processor.id_to_piece(i) for i in range(600)] == tok.convert_ids_to_tokens(list(range(600)))
    assert (processor.bos_id(), processor.eos_id(), processor.unk_id()) == (1, 2, 0)
    text = "hello world"
    assert processor.encode(text) == tok(text, add_special_tokens=False).input_ids


def test_peer_subprocess_protocol(peers, tmp_path, monkeypatch):
    """A fake peer driven exactly as the real ones: start-up, warm-up, runs, errors, quit."""
    runner = tmp_path / "run_fake.py"
    runner.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {peers.RUNNERS_DIR!r})
        from _protocol import main

        def load(model, dtype, threads, options, workloads):
            print("library noise on stdout")  # must not corrupt the replies
            def generate(prompts, max_tokens):
                if options.get("fail"):
                    raise ValueError("boom")
                return [[(p[0] + i) % 7 for i in range(n)] for p, n in zip(prompts, max_tokens)]
            return generate

        raise SystemExit(main(lambda: {{"engine": "fake", "version": "0"}}, load, None))
    """))
    monkeypatch.setattr(peers, "runner_script", lambda engine: str(runner))
    assert peers.probe("fake", sys.executable) == {"engine": "fake", "version": "0"}
    workload_file = tmp_path / "workload.json"
    workload_file.write_text(json.dumps({"full": {"prompts": [[3, 4], [5]], "max_tokens": [2, 3]},
                                         "warmup": {"prompts": [[3, 4], [5]], "max_tokens": [1, 1]}}))
    engine = peers.PeerEngine("fake", sys.executable, "model", "float32", 1, str(workload_file), {},
                              str(tmp_path / "fake.log"))
    try:
        assert engine.startup_s >= 0
        assert engine.run("warmup")[1] == [[3], [5]]
        elapsed, ids = engine.run("full")
        assert elapsed >= 0 and ids == [[3, 4], [5, 6, 0]]
    finally:
        engine.close()
    assert engine.process.returncode == 0
    assert "library noise" in (tmp_path / "fake.log").read_text()

    failing = peers.PeerEngine("fake", sys.executable, "model", "float32", 1, str(workload_file), {"fail": True},
                               str(tmp_path / "fail.log"))
    try:
        with pytest.raises(RuntimeError, match="boom"):
            failing.run("full")
    finally:
        failing.close()
