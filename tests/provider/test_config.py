from __future__ import annotations

from pathlib import Path

import pytest

from darkbloom.provider.config import ConfigError, ModelSpec, ProviderConfig, default_toml, load_config, ws_url


def write_toml(home: Path, text: str) -> None:
    (home / "provider.toml").write_text(text)


def test_defaults_without_a_file(home: Path) -> None:
    config = load_config(home, {})
    assert config.coordinator_url == "http://127.0.0.1:8080"
    assert config.backend == "llama-cpp"
    assert (config.max_concurrency, config.max_concurrency_chosen) == (4, False)
    assert config.heartbeat_interval_secs == 5
    assert config.models == [ModelSpec("smollm2-135m", "")]
    assert (config.local_endpoint, config.local_port, config.local_bind) == (False, 8000, "127.0.0.1")
    assert config.private_only is False
    assert config.max_body_bytes == 8 * 1024 * 1024
    assert config.name


def test_toml_is_read(home: Path, gguf: Path) -> None:
    write_toml(home, f"""
[coordinator]
url = "https://coord.example:9443/"
private_only = true
heartbeat_interval_secs = 2
[backend]
kind = "llama-cpp"
max_concurrency = 3
[[models]]
id = "mine"
path = "{gguf}"
[[models]]
id = "smollm2-135m"
path = ""
[local]
port = 9000
bind = "0.0.0.0"
max_body_bytes = 65536
[node]
name = "studio"
""")
    config = load_config(home, {})
    assert config.coordinator_url == "https://coord.example:9443"
    assert config.private_only is True
    assert config.heartbeat_interval_secs == 2.0
    assert config.max_concurrency == 3
    assert config.models == [ModelSpec("mine", str(gguf)), ModelSpec("smollm2-135m", "")]
    assert (config.local_port, config.local_bind, config.name) == (9000, "0.0.0.0", "studio")
    assert config.max_body_bytes == 65536


def test_overrides_win_over_the_file(home: Path, gguf: Path) -> None:
    write_toml(home, '[coordinator]\nurl = "http://a:1"\nprivate_only = true\n[backend]\nmax_concurrency = 4\n')
    config = load_config(home, {"coordinator_url": "http://b:2", "private_only": False, "max_concurrency": 1,
                                "models": ["smollm2-135m", f"other={gguf}"], "local_endpoint": True,
                                "local_port": 8123, "local_bind": "0.0.0.0"})
    assert config.coordinator_url == "http://b:2"
    assert config.private_only is False
    assert config.max_concurrency == 1
    assert config.models == [ModelSpec("smollm2-135m", ""), ModelSpec("other", str(gguf))]
    assert (config.local_endpoint, config.local_port, config.local_bind) == (True, 8123, "0.0.0.0")


def test_extra_buffer_types_are_off_unless_the_file_or_the_environment_turns_them_on(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DARKBLOOM_LLAMA_EXTRA_BUFTS", raising=False)
    assert load_config(home, {}).extra_buffer_types is False
    write_toml(home, "[backend]\nextra_buffer_types = true\n")
    assert load_config(home, {}).extra_buffer_types is True
    monkeypatch.setenv("DARKBLOOM_LLAMA_EXTRA_BUFTS", "0")
    assert load_config(home, {}).extra_buffer_types is False
    (home / "provider.toml").unlink()
    monkeypatch.setenv("DARKBLOOM_LLAMA_EXTRA_BUFTS", "1")
    assert load_config(home, {}).extra_buffer_types is True


def test_gpu_layers_are_the_builds_choice_unless_the_file_or_a_flag_says(home: Path) -> None:
    assert load_config(home, {}).gpu_layers is None  # every layer where the build can offload (gpu_offload)
    write_toml(home, "[backend]\ngpu_layers = 20\n")
    assert load_config(home, {}).gpu_layers == 20
    assert load_config(home, {"gpu_layers": "0"}).gpu_layers == 0  # the flag wins: the CPU only
    for every in ("all", "ALL", "-1"):
        assert load_config(home, {"gpu_layers": every}).gpu_layers == -1
    write_toml(home, '[backend]\ngpu_layers = "all"\n')
    assert load_config(home, {}).gpu_layers == -1
    write_toml(home, "[backend]\ngpu_layers = -1\n")
    assert load_config(home, {}).gpu_layers == -1


def test_openai_backend_takes_model_names_without_files(home: Path) -> None:
    config = load_config(home, {"backend": "openai", "upstream_url": "http://127.0.0.1:11434/v1/",
                                "models": ["llama3.2:1b", "meta-llama/Llama-3.2-1B-Instruct"]})
    assert config.upstream_url == "http://127.0.0.1:11434/v1"
    assert config.model_ids == ["llama3.2:1b", "meta-llama/Llama-3.2-1B-Instruct"]


@pytest.mark.parametrize("overrides, toml, needle", [
    ({"backend": "vllm"}, "", "unknown backend 'vllm'"),
    ({"backend": "openai"}, "", "--upstream-url"),
    ({"backend": "openai", "upstream_url": "ftp://x"}, "", "must look like http://host:port"),
    ({"max_concurrency": 0}, "", "max_concurrency must be at least 1"),
    ({"models": ["mine=/nonexistent/model.gguf"]}, "", "not found: /nonexistent/model.gguf"),
    ({"models": ["mine"]}, "", "--model mine=/path/to/model.gguf"),
    ({"models": ["=x.gguf"]}, "", "has no model id"),
    ({"models": ["smollm2-135m", "smollm2-135m"]}, "", "configured twice"),
    ({"models": ["+cmd|' /C calc'!A0=/x.gguf"]}, "", "cannot be advertised"),
    ({"models": ["@SUM(1+1)"]}, "", "--model ID=PATH"),
    ({"models": ["-2+3"]}, "", "letters, digits and . _ : / -"),
    ({"models": ["two words=/x.gguf"]}, "", "cannot be advertised"),
    ({"models": ["m" * 257]}, "", "cannot be advertised"),
    ({"backend": "openai", "upstream_url": "http://u", "models": ["@SUM(1+1)"]}, "",
     "the id is the upstream's model name"),
    ({}, '[[models]]\nid = "=HYPERLINK(\\"http://evil.example/\\")"\npath = "/x.gguf"\n', "cannot be advertised"),
    ({"max_concurrency": 1025}, "", "max_concurrency must be at most 1024"),
    ({}, "[backend]\ncontext_length = 20000000\n", "context_length must be at most 16777216"),
    ({"max_memory_gb": 1e12}, "", "max_memory_gb must be a number of GB greater than 0 and at most"),
    ({"coordinator_url": "localhost:8080"}, "", "must look like http://host:port"),
    ({"local_port": 70000}, "", "not a valid TCP port"),
    ({}, "[coordinator\nurl=", "not valid TOML"),
    ({}, "[backend]\nmax_concurrency = true\n", "provider.toml: [backend] max_concurrency must be of type int, not True"),
    ({}, "[backend]\nkind = 3\n", "[backend] kind must be of type str, not 3"),
    ({}, "[coordinator]\nprivate_only = \"yes\"\n", "[coordinator] private_only must be of type bool, not 'yes'"),
    ({}, "[coordinator]\nheartbeat_interval_secs = \"5\"\n", "heartbeat_interval_secs must be of type int or float"),
    ({}, "[local]\nport = 80.5\n", "[local] port must be of type int, not 80.5"),
    ({}, "[local]\nmax_body_bytes = 0\n", "[local] max_body_bytes must be at least 1"),
    ({}, "local = 3\n", "provider.toml: [local] must be a table"),
    ({}, "models = 3\n", "[[models]] tables"),
    ({}, "models = [3]\n", "[[models]] tables"),
    ({}, "[[models]]\nid = \"a\"\n[[models]]\nid = 7\n", "[[models]] #2 id must be of type str, not 7"),
    ({"surprise": 1}, "", "unknown setting 'surprise'"),
    ({"gpu_layers": "-2"}, "", "--gpu-layers must be 0 (the CPU only), a number of layers up to 65536 to put on "
                               "the GPU, or -1 or \"all\" (every layer); got '-2'"),
    ({"gpu_layers": "1.5"}, "", "--gpu-layers must be 0 (the CPU only)"),
    ({"gpu_layers": "most"}, "", "got 'most'"),
    ({"gpu_layers": "70000"}, "", "up to 65536"),
    ({}, "[backend]\ngpu_layers = -3\n", "provider.toml: [backend] gpu_layers must be 0 (the CPU only)"),
    ({}, "[backend]\ngpu_layers = 2.5\n", "[backend] gpu_layers must be 0"),
    ({}, "[backend]\ngpu_layers = true\n", "got True"),
    ({}, '[backend]\ngpu_layers = "half"\n', "got 'half'"),
])
def test_invalid_settings_raise_a_sentence(home: Path, overrides: dict[str, object], toml: str,
                                           needle: str) -> None:
    if toml:
        write_toml(home, toml)
    with pytest.raises(ConfigError) as info:
        load_config(home, overrides)
    assert needle in str(info.value)


@pytest.mark.parametrize("url, expected", [
    ("http://127.0.0.1:8080", "ws://127.0.0.1:8080/ws/provider"),
    ("https://darkbloom.example", "wss://darkbloom.example/ws/provider"),
    ("https://darkbloom.example/prefix/", "wss://darkbloom.example/prefix/ws/provider"),
    ("ws://h:1/ws/provider", "ws://h:1/ws/provider"),
])
def test_ws_url(url: str, expected: str) -> None:
    assert ws_url(ProviderConfig(coordinator_url=url)) == expected


def test_default_toml_round_trips(home: Path) -> None:
    write_toml(home, default_toml('http://h:9/"odd"'))
    config = load_config(home, {})
    assert config.coordinator_url == 'http://h:9/"odd"'
    assert config.model_ids == ["smollm2-135m"]
