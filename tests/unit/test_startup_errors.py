"""A service's start-up error (a bad config: exit 2, before logging is set up) in the format its logs are in.

The chart sets GYRE_LOG__FORMAT=json: a collector that reads one JSON object per line got the config error, the one
line that says why the pod is crash-looping, as unparsable text. Each entry point that can fail so is run for real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SERVICES = ["trainer", "orchestrator", "inference"]
FIELDS = {"time", "level", "severity", "service", "logger", "message"}  # gyre.logging's JSON records


def gyre(*args: str, env: dict[str, str] | None = None, cwd=None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.upper().startswith("GYRE_")} | (env or {})
    cmd = [sys.executable, "-m", "gyre.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=environ, cwd=cwd)


def records(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines()]  # every line is one object, or json.loads fails


@pytest.mark.parametrize("service", SERVICES)
def test_a_bad_key_is_one_json_record_when_the_environment_selects_json(service):
    res = gyre(service, "--bogus-key", "1", env={"GYRE_LOG__FORMAT": "json", "GYRE_RUN_ID": "exp1"})
    assert res.returncode == 2
    [record] = records(res.stderr)
    assert record.keys() >= FIELDS
    assert record["level"] == record["severity"] == "ERROR"
    assert record["service"] == service and record["run_id"] == "exp1"
    assert record["message"].startswith(f"gyre {service}: error: config key 'bogus_key'")


@pytest.mark.parametrize("service", SERVICES)
def test_a_bad_key_is_one_json_record_when_the_config_selects_json(service, tmp_path):
    config = tmp_path / "service.toml"
    config.write_text('run_id = "exp2"\n[log]\nformat = "json"\n[bogus]\nx = 1\n')
    res = gyre(service, "@", str(config))
    assert res.returncode == 2
    [record] = records(res.stderr)
    assert record["service"] == service and record["run_id"] == "exp2"
    assert "config key 'bogus'" in record["message"]
    # an option over the environment, as the config reads them; and a file that cannot be read still says json
    res = gyre(service, "--log.format", "json", "@", str(tmp_path / "missing.toml"), env={"GYRE_LOG__FORMAT": "text"})
    assert res.returncode == 2 and "config file not found" in records(res.stderr)[0]["message"]


@pytest.mark.parametrize("service", SERVICES)
def test_a_bad_key_stays_text_without_json(service):
    res = gyre(service, "--bogus-key", "1")
    assert res.returncode == 2
    assert res.stderr.startswith(f"gyre {service}: error: config key 'bogus_key'")
    res = gyre(service, "--log.format", "text", "--bogus-key", "1", env={"GYRE_LOG__FORMAT": "json"})
    assert res.stderr.startswith(f"gyre {service}: error:")  # the option wins over the environment


def test_gyre_rl_errors_stay_text_for_its_console():
    # gyre rl's own lines are a person's console; log.format is its services' (their log files)
    res = gyre("rl", "--bogus-key", "1", env={"GYRE_LOG__FORMAT": "json"})
    assert res.returncode == 2 and res.stderr.startswith("gyre rl: error: config key 'bogus_key'")


@pytest.mark.parametrize("service", ["trainer", "inference", "sft"])
def test_a_missing_model_is_one_json_record_too(service, tmp_path):
    # the model check runs after the config is read, before logging is set up: it printed text under the chart's JSON
    missing = tmp_path / "no-model"
    data = ["--data.fake"] if service == "sft" else []
    res = gyre(service, "--model.name", str(missing), *data, env={"GYRE_LOG__FORMAT": "json", "GYRE_RUN_ID": "exp3"})
    assert res.returncode == 2
    [record] = records(res.stderr)
    assert record["service"] == service and record["run_id"] == "exp3" and record["level"] == "ERROR"
    assert record["message"].startswith(f"gyre {service}: error: ") and str(missing) in record["message"]
    res = gyre(service, "--model.name", str(missing), *data)
    assert res.returncode == 2 and res.stderr.startswith(f"gyre {service}: error: ")


def test_a_model_file_given_to_the_torch_backend_is_one_json_record_too(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    res = gyre("inference", "--model.name", str(tmp_path / "model.gguf"), "--log.format", "json")
    assert res.returncode == 2
    [record] = records(res.stderr)
    assert "is a file, not a model folder (`gyre model import FILE --output-dir DIR`" in record["message"]


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_a_hub_warning_is_one_line_in_the_services_format(fmt):
    # huggingface_hub's own stderr handler printed each of its warnings (a request retried while a model is looked up)
    # a second time, as bare text: under JSON, a line a collector cannot parse; under text, every line twice
    code = ("from gyre.logging import setup_logging\n"
            f"setup_logging('info', None, 'inference', {fmt!r}, 'exp4')\n"
            "from huggingface_hub.utils import logging as hub_logging\n"
            "hub_logging.get_logger('huggingface_hub.utils._http').warning('Retrying in 1s [Retry 1/5].')\n"
            )  # fmt: skip
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    [line] = res.stderr.splitlines()
    if fmt == "json":
        record = json.loads(line)
        assert record["message"] == "Retrying in 1s [Retry 1/5]." and record["service"] == "inference"
    else:
        assert line.endswith("WARNING inference huggingface_hub.utils._http: Retrying in 1s [Retry 1/5].")


def test_a_lora_target_that_names_no_layer_is_one_json_record_before_redis(tiny_model):
    # a trainer pod crash-looped with a traceback once it had loaded the model; now one record, before it connects
    # anywhere (the Redis URL here leads nowhere)
    env = {"GYRE_LOG__FORMAT": "json", "GYRE_RUN_ID": "exp4"}
    res = gyre("trainer", "--model.name", str(tiny_model), "--lora.target-modules", '["q_proj", "v_prj"]',
               "--redis.url", "redis://127.0.0.1:1/0", env=env)  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    [record] = records(res.stderr)
    assert record["message"].startswith("gyre trainer: error: config key 'lora.target_modules': 'v_prj' names no "
                                        "layer of the model (did you mean 'v_proj'?)"), record  # fmt: skip
