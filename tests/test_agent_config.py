"""Config precedence (flag > env > TOML > default) and one-sentence errors for bad values."""

from __future__ import annotations

import os

import pytest

from gpuagent.agent.config import ConfigError, load_config


def _toml(tmp_path, text):
    p = tmp_path / "agent.toml"
    p.write_text(text)
    return str(p)


def test_defaults_without_file():
    cfg = load_config(None, env={})
    assert cfg.interval_s == 1.0
    assert cfg.batch_interval_s == 5.0
    assert cfg.state_dir == "/var/lib/gpuagent"
    assert cfg.spool_max_bytes == 512 * 1024 * 1024
    # /etc/gpuagent/agent.toml is read only when it exists (it does not on CI, and then nothing is read).
    assert cfg.config_file == ("/etc/gpuagent/agent.toml" if os.path.exists("/etc/gpuagent/agent.toml") else "")


def test_precedence_flag_over_env_over_file(tmp_path):
    path = _toml(tmp_path, """
[collector]
address = "file-host:7000"
token = "from-file"
[agent]
interval_s = 2.5
batch_interval_s = 7
state_dir = "/srv/file-state"
spool_max_bytes = "64MiB"
[labels]
pool = "a100-cloud"
price_per_gpu_hour = 2.25
team = "vision"
[probes]
enabled = true
collective = { interval_s = 3600 }
[jobs]
cmdline_regex = ["train\\\\.py"]
step_socket = "/tmp/x.sock"
""")
    env = {"GPUAGENT_COLLECTOR": "env-host:7100", "GPUAGENT_INTERVAL": "3", "GPUAGENT_LABELS": "region=eu-west,pool=h100"}
    cfg = load_config(path, env=env, interval_s=0.5)
    assert cfg.collector.address == "env-host:7100"         # env beats file
    assert cfg.interval_s == 0.5                              # flag beats env
    assert cfg.batch_interval_s == 7.0                        # file beats default
    assert cfg.state_dir == "/srv/file-state"
    assert cfg.spool_max_bytes == 64 * 1024 * 1024
    assert cfg.collector.token == "from-file"
    assert dict(cfg.labels) == {"pool": "h100", "price_per_gpu_hour": "2.25", "team": "vision", "region": "eu-west"}
    assert cfg.probes.enabled is True and cfg.probes.schedule("collective").interval_s == 3600
    assert cfg.jobs.rules.cmdline_regex == (r"train\.py",) and cfg.jobs.step_socket == "/tmp/x.sock"
    cfg2 = load_config(path, env=env, collector="flag-host:7200", state_dir=str(tmp_path))
    assert cfg2.collector.address == "flag-host:7200" and cfg2.state_dir == str(tmp_path)
    with pytest.raises(AttributeError):
        cfg2.interval_s = 9           # frozen
    with pytest.raises(TypeError):
        cfg2.labels["pool"] = "x"     # read-only mapping


def test_config_file_from_env_and_token_file(tmp_path):
    tok = tmp_path / "token"
    tok.write_text("s3cret\n")
    path = _toml(tmp_path, f'[collector]\ntoken_file = "{tok}"\n')
    cfg = load_config(None, env={"GPUAGENT_CONFIG": path})
    assert cfg.config_file == path
    assert cfg.resolved_token() == "s3cret"
    assert cfg.to_dict()["collector"]["token"] == ""


@pytest.mark.parametrize("text, env, needle", [
    ("[agent]\ninterval_s = -1\n", {}, "agent.interval_s (from config file"),
    ("[agent]\ninterval_s = \"fast\"\n", {}, "must be a number"),
    ("[agent]\nintervall_s = 1\n", {}, "unknown key agent.intervall_s"),
    ("[colector]\naddress = 'x:1'\n", {}, "unknown table or key 'colector'"),
    ("[collector]\naddress = \"nohost\"\n", {}, "collector.address (from config file"),
    ("[agent]\nspool_max_bytes = \"lots\"\n", {}, "agent.spool_max_bytes"),
    ("[labels]\nprice_per_gpu_hour = \"cheap\"\n", {}, "labels.price_per_gpu_hour"),
    ("[jobs]\ncmdline_regex = [\"(\"]\n", {}, "jobs.cmdline_regex (from config file"),
    ("[jobs]\nrulez = 1\n", {}, "unknown key 'jobs.rulez'"),
    ("interval_s = [1\n", {}, "is not valid TOML"),
    ("[probes]\nhost = 3\n", {}, "[probes] (from config file"),
    ("[probes.host]\nenabled = \"maybe\"\n", {}, "[probes.host] enabled must be true or false"),
    ("[jobs]\nstep_listener = \"maybe\"\n", {}, "jobs.step_listener (from config file"),
    ("[jobs]\nkubernetes = \"maybe\"\n", {}, "jobs.kubernetes (from config file"),
    ("[jobs]\nkubernetes_refresh_s = 0\n", {}, "jobs.kubernetes_refresh_s (from config file"),
    ("[jobs]\nnet_interval_s = 0\n", {}, "jobs.net_interval_s (from config file"),
    ("[jobs]\nnet_interval_s = \"often\"\n", {}, "jobs.net_interval_s (from config file"),
    ("[hardware]\nethernet_speed_mbps = 100000\n", {}, "hardware.ethernet_speed_mbps (from config file"),
    ("[hardware]\nethernet_speed_mbps = { \"ens*\" = \"fast\" }\n", {}, "'ens*' = 'fast' must name a device"),
    ("[hardware]\nethernet_speed_mbps = { \"ens*\" = 0 }\n", {}, "in whole Mb/s above 0"),
    ("", {"GPUAGENT_INTERVAL": "soon"}, "agent.interval_s (from environment GPUAGENT_INTERVAL)"),
    ("", {"GPUAGENT_LABELS": "justtext"}, "GPUAGENT_LABELS"),
])
def test_bad_config_is_one_sentence_naming_the_key(tmp_path, text, env, needle):
    path = _toml(tmp_path, text)
    with pytest.raises(ConfigError) as ei:
        load_config(path, env=env)
    msg = str(ei.value)
    assert needle in msg
    assert "\n" not in msg and msg.endswith(".")


def test_hardware_ethernet_speed_manifest_is_read(tmp_path):
    cfg = load_config(_toml(tmp_path, '[hardware]\nethernet_speed_mbps = { "ens*" = 200000, eno1 = 1000 }\n'), env={})
    assert dict(cfg.hardware.ethernet_speed_mbps) == {"ens*": 200000, "eno1": 1000}
    assert dict(map(tuple, cfg.to_dict()["hardware"]["ethernet_speed_mbps"])) == {"ens*": 200000, "eno1": 1000}


def test_probes_and_jobs_are_typed_once_with_one_boolean_parser(tmp_path):
    path = _toml(tmp_path, "[probes]\nforce = \"yes\"\n[probes.host]\nenabled = \"off\"\n"
                           "[jobs]\nstep_listener = \"no\"\nscan_interval_s = 2\nnet_interval_s = 10\n")
    cfg = load_config(path, env={"GPUAGENT_PROBES_ENABLED": "0"})
    assert cfg.probes.enabled is False and cfg.probes.force is True
    assert cfg.probes.schedule("host").enabled is False and cfg.probes.schedule("storage").enabled is True
    assert cfg.jobs.step_listener is False and cfg.jobs.scan_interval_s == 2.0 and cfg.jobs.step_window_s is None
    assert cfg.jobs.net_interval_s == 10.0


def test_missing_named_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"), env={})


def test_cli_run_bad_config_exits_with_sentence(tmp_path):
    from click.testing import CliRunner

    from gpuagent.agent.cli import main
    path = _toml(tmp_path, "[agent]\ninterval_s = 0\n")
    res = CliRunner().invoke(main, ["run", "--config", path, "--state-dir", str(tmp_path / "s")])
    assert res.exit_code == 1
    assert "agent.interval_s" in res.output and "Traceback" not in res.output


def test_example_config_with_every_commented_key_enabled_loads_and_shows_the_defaults(tmp_path):
    """packaging/agent.toml documents optional keys as comments; enabled, they must load (an example table the
    agent refuses would mislead whoever copies it), and the job-discovery values shown are the defaults."""
    import re
    from pathlib import Path

    from gpuagent.agent.config import DEFAULT_CMDLINE, DEFAULT_ENV_KEYS, JobRules

    text = (Path(__file__).resolve().parents[1] / "packaging" / "agent.toml").read_text()
    enabled = "\n".join(re.sub(r"^# ((\[[a-z_.]+\])|([a-z_0-9]+ = .*))$", r"\1", line) for line in text.splitlines())
    assert enabled.count("\n[") > text.count("\n[")          # some commented tables were enabled
    p = tmp_path / "agent.toml"
    p.write_text(enabled)
    cfg = load_config(str(p), env={})
    assert cfg.jobs.rules.cmdline_regex == DEFAULT_CMDLINE and cfg.jobs.rules.env_keys == DEFAULT_ENV_KEYS
    assert cfg.jobs.rules.env_argv0_regex == JobRules().env_argv0_regex
    assert cfg.jobs.step_socket == "/run/gpuagent/jobs.sock"
