"""EngineArgs is the one place a setting is written: flags, LLM keywords and defaults all come from it; the same
for the server's ServerSettings (and DataParallelConfig) and `pagedllm serve`'s own flags."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from pagedllm.config import (
    ENGINE_ARG_GROUPS,
    SERVER_ARG_GROUPS,
    EngineArgs,
    SpeculativeConfig,
    check_setting_names,
    setting,
)
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.engine_flags import (
    add_engine_args,
    add_field_flag,
    declared_settings,
    engine_args_from_cli,
    flag_name,
)
from pagedllm.entrypoints.openai.settings import ServerSettings
from pagedllm.entrypoints.serve_cli import add_server_args, server_settings
from pagedllm.serving import data_parallel
from pagedllm.serving.data_parallel import DataParallelConfig

FIELD_NAMES = [spec.name for spec in dataclasses.fields(EngineArgs)]


def _subcommand_parser(command: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parser


# Each command with the arguments it needs besides the flags under test.
COMMANDS = {"generate": ["hello"], "chat": [], "serve": []}


def _parse(command: str, flags: list[str]) -> EngineArgs:
    parser = _serve_parser() if command == "serve" else _subcommand_parser(command)
    return engine_args_from_cli(parser.parse_args(COMMANDS[command] + flags))


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_has_a_flag_whose_default_is_the_fields(command: str) -> None:
    parser = _serve_parser() if command == "serve" else _subcommand_parser(command)
    options = parser._option_string_actions
    for name in FIELD_NAMES:
        assert flag_name(name) in options, f"{command} has no flag for EngineArgs.{name}"
        assert options[flag_name(name)].dest == name
    # No flag given: exactly EngineArgs' defaults, field by field.
    assert _parse(command, []) == EngineArgs()


def test_every_field_is_an_llm_keyword() -> None:
    check_setting_names(FIELD_NAMES, "LLM()")  # raises on a name LLM would refuse


def test_unknown_llm_keyword_names_the_closest_settings() -> None:
    from pagedllm.entrypoints.llm import LLM

    # Refused before any model loads.
    with pytest.raises(TypeError, match=r"'max_num_seq' \(did you mean 'max_num_seqs'") as info:
        LLM(max_num_seq=4)
    assert "EngineArgs" in str(info.value)
    with pytest.raises(
        TypeError,
        match=r"settings 'enable_prefix_cache' \(did you mean 'enable_prefix_caching'.*"
        r"'zzz'; every setting",
    ):
        LLM(enable_prefix_cache=False, zzz=1)


def test_llm_keywords_reach_the_engine(tiny_model_factory) -> None:
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(
        model=tiny_model_factory("llama"),
        kv_cache_memory="1MiB",
        swap_space="2MiB",
        max_num_seqs=3,
        long_prompt_chunk_tokens=32,
        enable_prefix_caching=False,
        device="cpu",
    )
    engine = llm.llm_engine
    assert engine.scheduler_config.max_num_seqs == 3
    assert engine.scheduler_config.long_prompt_chunk_tokens == 32
    assert engine.cache_config.kv_cache_memory == 1 << 20
    assert engine.cache_config.swap_space == 2 << 20
    assert engine.cache_config.enable_prefix_caching is False


def test_help_lists_the_groups(capsys) -> None:
    for command in ("generate", "chat", "serve"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        text = capsys.readouterr().out
        used = {spec.metadata.get("group", ENGINE_ARG_GROUPS[-1]) for spec in dataclasses.fields(EngineArgs)}
        for title in ENGINE_ARG_GROUPS:
            if title in used:
                assert f"\n{title}:\n" in text, f"{command} --help lacks the group {title!r}"
        assert "Token slots per KV block" in text


@pytest.mark.parametrize("command", COMMANDS)
def test_flags_round_trip_into_engine_args(command: str) -> None:
    args = _parse(
        command,
        [
            "--max-num-seqs",
            "7",
            "--num-kv-blocks",
            "32",
            "--kv-cache-memory",
            "2GiB",
            "--swap-space",
            "512MiB",
            "--kv-cache-dtype",
            "int8",
            "-q",
            "int4",
            "-tp",
            "2",
            "--no-prefix-caching",
            "--no-enable-chunked-prefill",
            "--track-kv-waste",
            "--no-int8-activations",
            "--preemption-mode",
            "swap",
            "--dtype",
            "float32",
            "--speculative-config",
            '{"method": "suffix", "num_speculative_tokens": 8}',
            "--long-prompt-chunk-tokens",
            "0",
        ],
    )
    assert (args.max_num_seqs, args.num_kv_blocks, args.long_prompt_chunk_tokens) == (7, 32, 0)
    assert (args.kv_cache_memory, args.swap_space) == (2 << 30, 512 << 20)
    assert (args.kv_cache_dtype, args.quantization, args.tensor_parallel_size) == ("int8", "int4", 2)
    assert args.enable_prefix_caching is False and args.enable_chunked_prefill is False
    assert args.track_kv_waste is True and args.int8_activations is False
    assert (args.preemption_mode, args.dtype) == ("swap", "float32")
    assert args.speculative_config == SpeculativeConfig(method="suffix", num_speculative_tokens=8)
    assert _parse(command, ["--int8-activations", "--enable-prefix-caching"]).int8_activations is True


def test_serve_positional_model_wins_and_its_model_flag_feeds_the_field() -> None:
    parser = _serve_parser()
    assert engine_args_from_cli(parser.parse_args(["some/model"])).model == "some/model"
    assert engine_args_from_cli(parser.parse_args(["--model", "other/model"])).model == "other/model"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kv-cache-memory", "lots"], "Cannot read a memory size"),
        (["--kv-cache-dtype", "int3"], "invalid choice"),
        (["--max-num-seqs", "many"], "invalid int value"),
    ],
)
def test_bad_flag_values_are_refused_by_name(flags: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit):
        _subcommand_parser("generate").parse_args(["hello", *flags])
    err = capsys.readouterr().err
    assert flags[0] in err and message in err


def test_byte_sizes_are_read_by_engine_args_too() -> None:
    args = EngineArgs(kv_cache_memory="1.5GB", swap_space="4GiB")
    assert (args.kv_cache_memory, args.swap_space) == (1_500_000_000, 4 << 30)
    with pytest.raises(ValueError, match="Cannot read a memory size"):
        EngineArgs(swap_space="a lot")


def test_a_field_without_metadata_still_gets_a_working_flag() -> None:
    @dataclasses.dataclass
    class NewSettings:
        replica_budget: int | None = None
        pin_memory: bool = False
        hosts: list[str] = dataclasses.field(default_factory=list)
        mode: typing.Literal["a", "b"] = "a"

    parser = argparse.ArgumentParser()
    hints = typing.get_type_hints(NewSettings)
    for spec in dataclasses.fields(NewSettings):
        add_field_flag(parser, spec, hints[spec.name])
    parsed = parser.parse_args(["--replica-budget", "3", "--pin-memory", "--hosts", "x", "y", "--mode", "b"])
    assert vars(parsed) == {"replica_budget": 3, "pin_memory": True, "hosts": ["x", "y"], "mode": "b"}
    assert vars(parser.parse_args([])) == {"replica_budget": None, "pin_memory": False, "hosts": [], "mode": "a"}
    assert "--no-pin-memory" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "c"])


def test_a_command_flag_of_the_same_name_feeds_the_field() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-num-seqs", type=int, default=256, dest="max_num_seqs", help="the command's own")
    add_engine_args(parser)  # no conflict: the command's flag stands for the field
    assert engine_args_from_cli(parser.parse_args(["--max-num-seqs", "5"])).max_num_seqs == 5


def test_serve_flag_defaults_are_the_server_settings_defaults() -> None:
    assert server_settings(_serve_parser().parse_args([])) == ServerSettings()


# The server's own settings: ServerSettings' fields (and DataParallelConfig's user-facing ones) make serve's flags.
SERVER_FIELD_NAMES = [
    spec.name for spec in dataclasses.fields(ServerSettings) if spec.name not in ("engine_args", "data_parallel")
]
DATA_PARALLEL_FLAG_NAMES = ["data_parallel_size", "distributed_executor_backend", "ray_address", "router"]


def test_every_server_field_has_a_serve_flag_whose_default_is_the_fields() -> None:
    parser = _serve_parser()
    options = parser._option_string_actions
    expected = {
        **{name: getattr(ServerSettings(), name) for name in SERVER_FIELD_NAMES},
        **{name: getattr(DataParallelConfig(), name) for name in DATA_PARALLEL_FLAG_NAMES},
    }
    for name, default in expected.items():
        assert flag_name(name) in options, f"serve has no flag for {name}"
        action = options[flag_name(name)]
        assert action.dest == name
        assert action.default == default, f"{flag_name(name)} defaults to {action.default!r}, the field to {default!r}"
        assert action.help and "EngineArgs" not in action.help  # declared with setting(), its own help
    # Set in code only: no flag.
    assert "--max-restarts" not in options and "--health-interval-s" not in options
    assert options["-dp"].dest == "data_parallel_size"
    assert options["--disable-log-requests"].dest == "log_requests"


def test_server_fields_are_in_server_groups_and_engine_fields_in_engine_groups() -> None:
    for settings_class in (ServerSettings, DataParallelConfig):
        for spec, _ in declared_settings(settings_class):
            assert spec.metadata["group"] in SERVER_ARG_GROUPS, spec.name
    for spec in dataclasses.fields(EngineArgs):
        assert spec.metadata.get("group", ENGINE_ARG_GROUPS[-1]) in ENGINE_ARG_GROUPS, spec.name
    with pytest.raises(ValueError, match="group must be one of"):
        setting(1, "nowhere", "A setting in no group.")


def test_server_flags_round_trip_into_server_settings(monkeypatch) -> None:
    monkeypatch.setattr(data_parallel, "ray_installed", lambda: True)  # checked, never started
    args = _serve_parser().parse_args(
        [
            "some/model",
            "--host", "0.0.0.0",
            "--port", "9001",
            "--served-model-name", "a", "b",
            "--log-level", "DEBUG",
            "--disable-log-requests",
            "--timeout-body", "2.5",
            "--limit-concurrency", "3",
            "--max-request-bytes", "1024",
            "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes",
            "--reasoning-parser", "qwen3",
            "--responses-store-size", "0",
            "--root-path", "/api",
            "-dp", "2",
            "--router", "round_robin",
            "--distributed-executor-backend", "ray",
            "--ray-address", "auto",
            "--max-num-seqs", "5",
        ]
    )  # fmt: skip
    settings = server_settings(args)
    assert (settings.host, settings.port, settings.served_model_name) == ("0.0.0.0", 9001, ["a", "b"])
    assert (settings.log_level, settings.log_requests) == ("debug", False)
    assert (settings.timeout_body, settings.limit_concurrency, settings.max_request_bytes) == (2.5, 3, 1024)
    assert (settings.tool_call_parser, settings.enable_auto_tool_choice) == ("hermes", True)
    assert (settings.reasoning_parser, settings.responses_store_size, settings.root_path) == ("qwen3", 0, "/api")
    assert settings.data_parallel == DataParallelConfig(
        data_parallel_size=2, distributed_executor_backend="ray", ray_address="auto", router="round_robin"
    )
    # serve's --distributed-executor-backend stands in for EngineArgs' field as well.
    assert settings.engine_args.distributed_executor_backend == "ray"
    assert (settings.engine_args.model, settings.engine_args.max_num_seqs) == ("some/model", 5)
    assert server_settings(_serve_parser().parse_args(["--no-log-requests"])).log_requests is False


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--limit-concurrency", "0"], "must be >= 1, got 0"),
        (["-dp", "0"], "must be >= 1, got 0"),
        (["--max-prompts-per-request", "1.5"], "invalid int value"),
        (["--timeout-body", "0"], "must be a positive finite number"),
        (["--timeout-keep-alive", "inf"], "must be a positive finite number"),
        (["--timeout-headers", "soon"], "invalid float value"),
        (["--log-level", "loud"], "invalid choice"),
        (["--tool-call-parser", "nope"], "invalid choice"),
        (["--reasoning-parser", "nope"], "invalid choice"),
        (["--router", "random"], "invalid choice"),
        (["--distributed-executor-backend", "slurm"], "invalid choice"),
    ],
)
def test_bad_server_flag_values_are_refused_by_name(flags: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(flags)
    err = capsys.readouterr().err
    assert flags[0] in err and message in err


def test_auto_tool_choice_needs_a_tool_call_parser() -> None:
    with pytest.raises(SystemExit, match="--enable-auto-tool-choice needs --tool-call-parser"):
        server_settings(_serve_parser().parse_args(["--enable-auto-tool-choice"]))


def test_serve_help_keeps_the_server_groups(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    own_options = text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
    for flag in ("--model", "--host", "--port", "--api-key", "--log-level", "--disable-log-requests", "--root-path"):
        assert flag in own_options, f"{flag} is not among serve's own options"
    for title in SERVER_ARG_GROUPS[1:]:
        assert f"\n{title}:\n" in text
    limits = text.split(f"\n{SERVER_ARG_GROUPS[1]}:\n", 1)[1].split("\n\n", 1)[0]
    assert "--timeout-body" in limits and "--limit-concurrency" in limits
    replicas = text.split(f"\n{SERVER_ARG_GROUPS[3]}:\n", 1)[1].split("\n\n", 1)[0]
    assert "-dp" in replicas and "--distributed-executor-backend" in replicas


def test_scheduler_defaults_are_the_engine_settings_defaults():
    """A scheduler built directly (tests, the simulator) schedules as the engine built from EngineArgs() does."""
    import dataclasses

    from pagedllm.config import DEFAULT_CHUNKED_BATCHED_TOKENS, EngineArgs, SchedulerConfig

    engine_defaults = EngineArgs()
    scheduler = SchedulerConfig()
    shared = {f.name for f in dataclasses.fields(SchedulerConfig)} & {f.name for f in dataclasses.fields(EngineArgs)}
    assert {"long_prompt_chunk_tokens", "max_num_batched_tokens", "max_num_seqs"} <= shared
    for name in shared - {"max_num_batched_tokens", "max_model_len", "speculative_config"}:
        assert getattr(scheduler, name) == getattr(engine_defaults, name), name
    # None on both sides means the same rule: 512 with chunked prefill, else max(max_model_len, 8192).
    assert engine_defaults.max_num_batched_tokens is None
    assert scheduler.max_num_batched_tokens == DEFAULT_CHUNKED_BATCHED_TOKENS
    assert SchedulerConfig(enable_chunked_prefill=False, max_model_len=16384).max_num_batched_tokens == 16384
