"""A mix of environments ([[orchestrator.env]]): its config, the draw of each group's entry, and its resume state."""

from __future__ import annotations

import asyncio

import pytest
from gyre.config import ConfigError, load_config
from gyre.config.orchestrator import GyreEvalConfig, OrchestratorConfig
from gyre.envs import load_environment
from gyre_orchestrator.mix import TaskMix
from gyre_orchestrator.progress import Progress, ProgressStore, resume_point


def sources(*labels: str) -> dict:
    env = load_environment("reverse_text")
    return {label: env.tasks("train", seed=i) for i, label in enumerate(labels)}


def test_the_ratios_are_honoured_over_many_draws():
    mix = TaskMix(sources("a", "b", "c"), {"a": 6, "b": 3, "c": 1}, seed=7)
    drawn = [mix.next().env for _ in range(20000)]
    for label, share in (("a", 0.6), ("b", 0.3), ("c", 0.1)):
        assert drawn.count(label) / len(drawn) == pytest.approx(share, abs=0.015), label
    # each entry reads its own split in order: its cursor is how many of its tasks were drawn
    assert mix.cursors == {label: drawn.count(label) for label in "abc"} and mix.draws == 20000
    # and not only on average: any 8 draws in a row (a step's groups) hold each entry within 2 of its share
    for start in range(0, len(drawn) - 8):
        window = drawn[start : start + 8]
        assert all(abs(window.count(label) - 8 * share) <= 2 for label, share in (("a", 0.6), ("b", 0.3), ("c", 0.1)))


def test_the_draw_sequence_is_a_function_of_the_seed():
    def labels(seed: int) -> list[str]:
        mix = TaskMix(sources("a", "b"), {"a": 1, "b": 1}, seed=seed)
        return [mix.next().env for _ in range(200)]

    assert labels(3) == labels(3)
    assert labels(3) != labels(4)


def test_a_mix_rebuilt_from_its_state_continues_the_same_sequence():
    whole = TaskMix(sources("a", "b"), {"a": 2, "b": 1}, seed=1)
    expected = [(t.env, t.index, t.draw, t.task.id) for t in (whole.next() for _ in range(60))]
    first = TaskMix(sources("a", "b"), {"a": 2, "b": 1}, seed=1)
    head = [(t.env, t.index, t.draw, t.task.id) for t in (first.next() for _ in range(25))]
    cursors, draws = first.state()
    second = TaskMix(sources("a", "b"), {"a": 2, "b": 1}, seed=1, cursors=cursors, draws=draws)
    tail = [(t.env, t.index, t.draw, t.task.id) for t in (second.next() for _ in range(35))]
    assert head + tail == expected  # nothing repeated, nothing skipped


def test_new_ratios_change_only_the_draws_to_come_and_a_removed_entry_keeps_its_cursor():
    first = TaskMix(sources("a", "b"), {"a": 1, "b": 1}, seed=0)
    for _ in range(40):
        first.next()
    cursors, draws = first.state()
    # day two: b dropped, c added; a continues after its last task, c starts at its beginning
    second = TaskMix(sources("a", "c"), {"a": 1, "c": 3}, seed=0, cursors=cursors, draws=draws)
    drawn = [second.next() for _ in range(40)]
    assert [t.index for t in drawn if t.env == "a"] == list(range(cursors["a"], second.cursors["a"]))
    assert [t.index for t in drawn if t.env == "c"][:1] == [0]
    assert second.state()[0]["b"] == cursors["b"]  # saved again: should b come back, it continues


def test_one_environment_draws_in_index_order():
    mix = TaskMix(sources("only"), {"only": 1.0}, cursors={"only": 5})
    assert [(t.env, t.index, t.draw) for t in (mix.next() for _ in range(3))] == [("only", 5, 0), ("only", 6, 1),
                                                                                  ("only", 7, 2)]  # fmt: skip
    assert mix.index == 8


def test_progress_checkpoints_keep_the_cursors_and_draws_and_the_stream_wins_when_newer(tmp_path):
    store = ProgressStore(tmp_path)
    store.save(Progress(step=3, task_index=4, cursors={"a": 4, "b": 2}, draws=6))
    saved = store.load(-1)
    assert (saved.cursors, saved.draws) == ({"a": 4, "b": 2}, 6)
    # the newest batch in the stream drew further (its groups: after the checkpoint)
    point = resume_point(-1, store, committed=3, stream_steps=[4], cursors={"a": 7}, stream_draws=9)
    assert (point.start_step, point.cursors, point.draws) == (5, {"a": 7, "b": 2}, 9)
    # a rewind takes the checkpoint's own positions
    point = resume_point(3, store, committed=5, stream_steps=[])
    assert (point.cursors, point.draws) == ({"a": 4, "b": 2}, 6)


def test_a_checkpoint_from_before_mixes_reads_with_no_cursors(tmp_path):
    (tmp_path / "step_2.json").write_text('{"step": 2, "task_index": 16}')
    point = resume_point(-1, ProgressStore(tmp_path), committed=2, stream_steps=[])
    assert (point.task_index, point.cursors, point.draws) == (16, {}, 0)


# ---- config ------------------------------------------------------------------------------------------------------
def mix_config(entries, cls=OrchestratorConfig):
    return load_config(cls, [], env=entries)


def test_the_single_table_form_is_unchanged():
    cfg = load_config(OrchestratorConfig, ["--env.name", "arithmetic"])
    assert cfg.env.name == "arithmetic" and [e.key for e in cfg.envs] == ["arithmetic"]


def test_the_array_of_tables_form_is_a_mix(tmp_path):
    path = tmp_path / "mix.toml"
    path.write_text('[[env]]\nname = "reverse_text"\nratio = 3\n\n[[env]]\nname = "arithmetic"\n'
                    'args = { max_operand = 9 }\n')  # fmt: skip
    cfg = load_config(OrchestratorConfig, ["@", str(path)])
    assert [(e.key, e.ratio, e.args) for e in cfg.envs] == [("reverse_text", 3.0, {}),
                                                            ("arithmetic", 1.0, {"max_operand": 9})]  # fmt: skip
    assert [e.key for e in load_config(GyreEvalConfig, ["@", str(path)]).envs] == ["reverse_text", "arithmetic"]


@pytest.mark.parametrize(
    ("entries", "key", "message"),
    [
        ([{"name": "reverse_text", "ratio": 0}], "env.0.ratio", "greater than 0"),
        ([{"name": "reverse_text"}, {"name": "reverse_text", "ratio": -1}], "env.1.ratio", "greater than 0"),
        ([{"name": "reverse_text"}, {"name": "reverse_text"}], "env", "env.1.label"),
        ([{"name": "reverse_text", "label": "x"}, {"name": "arithmetic", "label": "x"}], "env", "distinct labels"),
        ([{"id": "reverse_text", "name": "rev"}], "env.0", "label = '...'"),
        ([{"id": "reverse_text"}], "env.0.id", "did you mean 'env.0.name'"),
        ([], "env", "at least one environment"),
        ([{"name": "reverse_text", "weight": 2}], "env.0.weight", ""),
    ],
)
def test_a_bad_mix_is_refused_naming_its_key(entries, key, message):
    for cls in (OrchestratorConfig, GyreEvalConfig):
        with pytest.raises(ConfigError) as error:
            mix_config(entries, cls)
        assert f"config key '{key}'" in str(error.value) and message in str(error.value)
        assert "Input should be a valid dictionary" not in str(error.value)  # one form's error, not both


def test_an_unknown_environment_of_a_mix_names_its_entry(tmp_path):
    from gyre_orchestrator.service import OrchestratorService

    cfg = load_config(OrchestratorConfig, [], output_dir=str(tmp_path),
                      env=[{"name": "reverse_text"}, {"name": "revers_text"}])  # fmt: skip
    with pytest.raises(ValueError, match=r"config key 'env\.1': unknown environment 'revers_text'"):
        OrchestratorService(cfg)


def test_a_dotted_option_sets_one_entry_of_a_mix(tmp_path):
    # day two, PRIME-RL's `--orchestrator.env.0.args.x`: `--env.1.ratio 2` replaced the whole list by {"1": ...} and
    # was refused as "unknown key 'env.1'"
    path = tmp_path / "mix.toml"
    path.write_text('[[env]]\nname = "reverse_text"\nratio = 3\n\n[[env]]\nname = "arithmetic"\nlabel = "math"\n')
    cfg = load_config(OrchestratorConfig, ["@", str(path), "--env.1.ratio", "2", "--env.0.args", '{"max_length": 5}'])
    assert [(e.key, e.ratio, e.args) for e in cfg.envs] == [("reverse_text", 3.0, {"max_length": 5}),
                                                            ("math", 2.0, {})]  # fmt: skip


def test_gyre_eval_of_a_mix_scores_each_entry_and_reports_it_by_label(tmp_path, monkeypatch, capsys):
    import json

    import gyre_orchestrator.eval_command as eval_command
    import gyre_orchestrator.evaluate as evaluate_module
    from gyre.events import read_events

    scores = {"rev": 0.8, "math": 0.2}

    async def fake_evaluate(env, client, *, env_name, **kwargs):  # each entry's own environment, by its label
        assert type(env).__name__ == {"rev": "ReverseTextEnv", "math": "ArithmeticEnv"}[env_name]
        return evaluate_module.EvalResult(env_name, scores[env_name], scores[env_name], 1, 2, 0, 0, 0.1)

    monkeypatch.setattr(evaluate_module, "evaluate", fake_evaluate)
    path = tmp_path / "mix.toml"
    path.write_text('[[env]]\nname = "reverse_text"\nlabel = "rev"\nratio = 3\n\n'
                    '[[env]]\nname = "arithmetic"\nlabel = "math"\n')  # fmt: skip
    base = ["--output-dir", str(tmp_path), "--inference.urls", '["http://127.0.0.1:9"]',
            "--inference.startup-timeout-s", "0"]  # fmt: skip
    assert eval_command.main(["@", str(path), *base]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {label: e["avg_at_k"] for label, e in printed["envs"].items()} == scores
    assert printed["avg_at_k"] == pytest.approx(0.75 * 0.8 + 0.25 * 0.2) and printed["num_examples"] == 4
    (line,) = read_events(tmp_path / "events" / "eval.jsonl")
    assert {key: line[key] for key in printed} == printed
    # an unknown environment names its entry
    assert eval_command.main(["@", str(path), *base, "--env.1.name", "arithmetik"]) == 2
    assert "config key 'env.1': unknown environment 'arithmetik'" in capsys.readouterr().err


def test_an_entry_without_a_saved_position_is_named_and_a_renamed_one_is_pointed_at(tmp_path, caplog):
    # day two: a label is an entry's key; renaming one silently restarted it at the beginning of its split
    from gyre_orchestrator.progress import ResumePoint
    from gyre_orchestrator.service import OrchestratorService

    cfg = load_config(OrchestratorConfig, [], output_dir=str(tmp_path),
                      env=[{"name": "reverse_text"}, {"name": "arithmetic", "label": "maths"}])  # fmt: skip

    async def main():  # the service is made inside an event loop, as `gyre orchestrator` makes it
        service = OrchestratorService(cfg)
        try:
            return service._task_mix(ResumePoint(3, 5, {}, "resumed", {"reverse_text": 5, "math": 4}, 9))
        finally:
            service.redis.close()

    mix = asyncio.run(main())
    assert (mix.cursors["reverse_text"], mix.cursors["maths"], mix.draws) == (5, 0, 9)
    assert "['maths'] have no saved position" in caplog.text and "positions of ['math']" in caplog.text


def test_a_table_option_over_a_mix_is_refused_not_taken_for_one_environment(tmp_path):
    # a single-environment habit on a mix, `--env.args.max_length 6`, replaced the whole mix by reverse_text (the
    # default name) with that argument, silently
    path = tmp_path / "mix.toml"
    path.write_text('[[env]]\nname = "arithmetic"\n\n[[env]]\nname = "reverse_text"\n')
    for option in ("--env.args.max_length", "--env.name"):
        with pytest.raises(ConfigError, match=r"config key 'env': is a list of 2 tables .* by its index \(--env\.0\."):
            load_config(OrchestratorConfig, ["@", str(path), option, "6"])
    whole = load_config(OrchestratorConfig, ["@", str(path), "--env", '[{"name": "arithmetic"}]'])
    assert [e.name for e in whole.envs] == ["arithmetic"]  # the whole list, as JSON, still replaces it


@pytest.mark.parametrize(
    ("values", "key", "message"),
    [
        ({"env": [{"name": "reverse_text"}, {"name": "arithmetic", "rollouts_per_example": 1}]},
         "env.1.rollouts_per_example", "1 sample per task"),
        ({"env": [{"name": "reverse_text", "rollouts_per_example": 0}]}, "env.0.rollouts_per_example", "greater than"),
        ({"env": {"name": "reverse_text", "rollouts_per_example": 1}}, "env.rollouts_per_example", "1 sample per task"),
        ({"env": [{"name": "reverse_text", "rollouts_per_example": 1}], "advantage": {"type": "rloo"}},
         "advantage.type", "needs env.0.rollouts_per_example >= 2"),
        ({"env": [{"name": "reverse_text"}, {"name": "arithmetic"}], "rollouts_per_example": 1},
         "rollouts_per_example", "1 sample per task"),  # an entry without its own: the orchestrator's key
        ({"env": [{"name": "reverse_text", "eval": {"num_examples": 0}}]}, "env.0.eval.num_examples", "greater than"),
        ({"env": [{"name": "reverse_text", "eval": {"every": 2}}]}, "env.0.eval.every", "unknown key"),
        ({"env": [{"name": "reverse_text", "eval": {"k": 0}}]}, "env.0.eval.k", "greater than"),
        ({"env": [{"name": "reverse_text"}, {"name": "arithmetic", "eval": {"interval": 5}}]}, "env.1.eval.interval",
         "evaluations are off (eval.interval unset)"),
        ({"env": [{"name": "reverse_text", "eval": {"enabled": False}}, {"name": "arithmetic",
          "eval": {"enabled": False}}], "eval": {"interval": 5}}, "env", "eval.interval = 5 would evaluate nothing"),
        ({"env": {"name": "reverse_text", "eval": {"enabled": False}}, "eval": {"interval": 5}}, "env.eval.enabled",
         "would evaluate nothing"),
        ({"env": [{"name": "reverse_text"}, {"name": "arithmetic", "eval": {"temperature": -0.5}}]},
         "env.1.eval.temperature", "greater than or equal to 0"),
        ({"env": [{"name": "reverse_text", "eval": {"max_tokens": 0}}]}, "env.0.eval.max_tokens", "greater than"),
        ({"env": [{"name": "reverse_text"}, {"name": "arithmetic", "sampling": {"max_tokens": 0}}]},
         "env.1.sampling.max_tokens", "greater than"),
        ({"env": [{"name": "reverse_text", "sampling": {"temperature": 0.7}}]}, "env.0.sampling",
         "the training temperature is the orchestrator's alone"),
        ({"env": [{"name": "reverse_text", "sampling": {"top_k": 5}}]}, "env.0.sampling.top_k", "unknown key"),
        # apply_chat_template's own arguments: the server refuses each request setting one (every rollout failed)
        ({"sampling": {"chat_template_kwargs": {"enable_thinking": False, "add_generation_prompt": False}}},
         "sampling.chat_template_kwargs", "may not set add_generation_prompt"),
        ({"env": [{"name": "reverse_text", "sampling": {"chat_template_kwargs": {"tools": [], "tokenize": True}}}]},
         "env.0.sampling.chat_template_kwargs", "may not set tokenize, tools"),
    ],
)  # fmt: skip
def test_an_entry_s_own_group_size_and_eval_settings_are_checked_naming_the_key(values, key, message):
    with pytest.raises(ConfigError) as error:
        load_config(OrchestratorConfig, [], **values)
    assert str(error.value).startswith(f"config key '{key}':") and message in str(error.value), error.value


def test_an_entry_s_group_size_and_eval_default_to_the_orchestrator_s(tmp_path):
    path = tmp_path / "mix.toml"
    path.write_text(
        "rollouts_per_example = 3\n[eval]\nnum_examples = 7\n\n"
        '[[env]]\nname = "reverse_text"\nrollouts_per_example = 6\n[env.eval]\nnum_examples = 2\nk = 4\n\n'
        '[[env]]\nname = "arithmetic"\neval = { enabled = false }\n\n[[env]]\nname = "alphabet_sort"\n'
    )
    cfg = load_config(OrchestratorConfig, ["@", str(path)])
    assert [cfg.group_size(e) for e in cfg.envs] == [6, 3, 3]
    from gyre_orchestrator.evaluate import EntryEval, eval_plan, mix_shares

    assert eval_plan(cfg) == {"reverse_text": EntryEval(2, "env.0.eval.num_examples", 4),
                              "alphabet_sort": EntryEval(7, "eval.num_examples", 1)}  # fmt: skip
    assert mix_shares(cfg) == {"reverse_text": 0.5, "alphabet_sort": 0.5}  # the evaluated entries' weights sum to 1
    # gyre eval reads the same entries: all of them off is refused, naming the key
    with pytest.raises(ConfigError, match=r"^config key 'env': .*gyre eval would evaluate nothing"):
        load_config(GyreEvalConfig, [], env=[{"name": "reverse_text", "eval": {"enabled": False}}])


def test_an_entry_s_sampling_lengths_and_eval_temperature_default_to_the_orchestrator_s(tmp_path):
    """PRIME-RL's eval sources sample by their own settings: an entry's eval.temperature and eval.max_tokens, else
    the orchestrator's eval.temperature and the entry's training length (its sampling.max_tokens, else the
    orchestrator's); its training max_tokens, else sampling.max_tokens. top_p applies to a sampled eval only."""
    from gyre.envs import SamplingParams
    from gyre_orchestrator.evaluate import eval_plan

    path = tmp_path / "mix.toml"
    path.write_text(
        "[sampling]\nmax_tokens = 64\ntop_p = 0.9\nseed = 5\n[eval]\ntemperature = 0.0\n\n"
        '[[env]]\nname = "arithmetic"\nlabel = "math"\nsampling = { max_tokens = 512 }\n\n'
        '[[env]]\nname = "reverse_text"\nlabel = "short"\neval = { temperature = 0.6, max_tokens = 32 }\n\n'
        '[[env]]\nname = "alphabet_sort"\nlabel = "sort"\n'
    )
    cfg = load_config(OrchestratorConfig, ["@", str(path)])
    assert [cfg.max_tokens(e) for e in cfg.envs] == [512, 64, 64]
    plan = eval_plan(cfg)
    assert plan["math"].sampling == SamplingParams(temperature=0.0, top_p=1.0, max_tokens=512, seed=5)
    assert plan["short"].sampling == SamplingParams(temperature=0.6, top_p=0.9, max_tokens=32, seed=5)
    assert plan["sort"].sampling == SamplingParams(temperature=0.0, top_p=1.0, max_tokens=64, seed=5)
    # the key that set each length, as an eval's "no task fits the context" names it (and a training run's)
    assert [p.length_key for p in plan.values()] == ["env.0.sampling.max_tokens", "env.1.eval.max_tokens",
                                                     "sampling.max_tokens"]  # fmt: skip
    assert [cfg.max_tokens_key(i) for i in range(3)] == ["env.0.sampling.max_tokens"] + ["sampling.max_tokens"] * 2
    # gyre eval reads the same keys of each entry
    plan = eval_plan(load_config(GyreEvalConfig, ["@", str(path)]))
    assert [p.sampling.max_tokens for p in plan.values()] == [512, 32, 64]
    assert [p.sampling.temperature for p in plan.values()] == [0.0, 0.6, 0.0]


def test_an_entry_s_chat_template_kwargs_replace_the_orchestrator_s_in_its_rollouts_and_evals(tmp_path):
    """sampling.chat_template_kwargs go with every request of an entry, training and eval; an entry's own table
    replaces them (not merged: an entry can drop a variable), as its max_tokens does."""
    from gyre_orchestrator.evaluate import eval_plan
    from gyre_orchestrator.service import OrchestratorService

    path = tmp_path / "mix.toml"
    path.write_text(
        f'output_dir = "{tmp_path / "run"}"\n'
        "[sampling.chat_template_kwargs]\nenable_thinking = false\nreasoning = 'low'\n\n"
        '[[env]]\nname = "arithmetic"\nlabel = "math"\nsampling = { chat_template_kwargs = { reasoning = "high" } }\n\n'
        '[[env]]\nname = "reverse_text"\nlabel = "short"\n'
    )
    cfg = load_config(OrchestratorConfig, ["@", str(path)])
    expected = {"math": {"reasoning": "high"}, "short": {"enable_thinking": False, "reasoning": "low"}}

    async def main():  # the service is made inside an event loop, as `gyre orchestrator` makes it
        service = OrchestratorService(cfg)
        service.redis.close()
        return service.entry_sampling

    assert {key: s.chat_template_kwargs for key, s in asyncio.run(main()).items()} == expected
    assert {key: p.sampling.chat_template_kwargs for key, p in eval_plan(cfg).items()} == expected
    # gyre eval reads the same keys; by default none are sent
    plan = eval_plan(load_config(GyreEvalConfig, ["@", str(path)]))
    assert {key: p.sampling.chat_template_kwargs for key, p in plan.items()} == expected
    assert load_config(OrchestratorConfig, []).sampling.chat_template_kwargs == {}


def test_gyre_eval_skips_an_entry_with_eval_off_and_gives_each_its_own_num_examples(tmp_path, monkeypatch, capsys):
    import json

    import gyre_orchestrator.eval_command as eval_command
    import gyre_orchestrator.evaluate as evaluate_module

    asked = {}

    async def fake_evaluate(env, client, *, env_name, num_examples, k, **kwargs):
        asked[env_name] = (num_examples, k)
        return evaluate_module.EvalResult(env_name, 0.5, 0.5, k, num_examples, 0, 0, 0.1)

    monkeypatch.setattr(evaluate_module, "evaluate", fake_evaluate)
    path = tmp_path / "mix.toml"
    path.write_text('[[env]]\nname = "reverse_text"\nlabel = "rev"\neval = { num_examples = 3, k = 4 }\n\n'
                    '[[env]]\nname = "arithmetic"\nlabel = "math"\neval = { enabled = false }\n\n'
                    '[[env]]\nname = "alphabet_sort"\nlabel = "sort"\n')  # fmt: skip
    base = ["--output-dir", str(tmp_path), "--inference.urls", '["http://127.0.0.1:9"]',
            "--inference.startup-timeout-s", "0", "--eval.num-examples", "5", "--eval.k", "2"]  # fmt: skip
    assert eval_command.main(["@", str(path), *base]) == 0
    assert asked == {"rev": (3, 4), "sort": (5, 2)}
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["envs"]) == {"rev", "sort"} and printed["num_examples"] == 8
    assert printed["k"] is None and {e["k"] for e in printed["envs"].values()} == {4, 2}  # no one k for the mix
    # an entry with eval off is not even loaded (a training-only environment need not load where gyre eval runs)
    assert eval_command.main(["@", str(path), *base, "--env.1.name", "no_such_env"]) == 0
    # an entry's eval split too small for its own num_examples is named by that entry's key
    from gyre.envs import TaskSource

    with pytest.raises(ValueError, match=r"env 'rev', env.0.eval.num_examples = 3: the eval split is empty"):
        env = load_environment("arithmetic")
        env.tasks = lambda split, seed=0: TaskSource(lambda i: None, 0)
        evaluate_module.eval_tasks(env, 3, "rev", "env.0.eval.num_examples")


def test_a_greedy_eval_of_several_samples_per_task_is_named_at_start(tmp_path, monkeypatch, caplog):
    """eval.k > 1 at temperature 0 repeats one greedy answer k times: pass@k is pass@1 at k times the cost, and
    nothing said so. gyre eval and a training run's evals warn once at start, naming the keys; a sampled entry's
    k > 1 is what pass@k is for and is not named."""
    import gyre_orchestrator.eval_command as eval_command
    import gyre_orchestrator.evaluate as evaluate_module
    import gyre_orchestrator.training_eval as training_eval

    async def fake_evaluate(env, client, *, env_name, num_examples, k, **kwargs):
        return evaluate_module.EvalResult(env_name, 0.5, 0.5, k, num_examples, 0, 0, 0.1)

    monkeypatch.setattr(evaluate_module, "evaluate", fake_evaluate)
    path = tmp_path / "mix.toml"
    path.write_text('[[env]]\nname = "reverse_text"\nlabel = "rev"\neval = { num_examples = 3, k = 4 }\n\n'
                    '[[env]]\nname = "alphabet_sort"\nlabel = "sort"\neval = { temperature = 0.7 }\n')  # fmt: skip
    base = ["--output-dir", str(tmp_path), "--inference.urls", '["http://127.0.0.1:9"]',
            "--inference.startup-timeout-s", "0", "--eval.num-examples", "2", "--eval.k", "2"]  # fmt: skip

    def greedy_warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "(greedy)" in r.getMessage()]

    with caplog.at_level("WARNING", logger="gyre_orchestrator.evaluate"):
        assert eval_command.main(["@", str(path), *base]) == 0
    assert len(greedy_warnings()) == 1, greedy_warnings()
    assert greedy_warnings()[0].startswith("env.0.eval.k = 4 at eval.temperature = 0 (greedy)")
    assert "set eval.temperature > 0" in greedy_warnings()[0]

    caplog.clear()
    cfg = load_config(OrchestratorConfig, ["@", str(path), "--eval.interval", "5", "--eval.k", "2"])
    envs = {entry.key: load_environment(entry.name) for entry in cfg.envs}
    with caplog.at_level("WARNING", logger="gyre_orchestrator.evaluate"):
        training_eval.TrainingEval(cfg, envs, None, events=None, wandb=None, metrics=None)
    assert [m.split(" (greedy)")[0] for m in greedy_warnings()] == ["env.0.eval.k = 4 at eval.temperature = 0"]
    # evals off: nothing to say
    caplog.clear()
    with caplog.at_level("WARNING", logger="gyre_orchestrator.evaluate"):
        training_eval.TrainingEval(load_config(OrchestratorConfig, ["@", str(path)]), envs, None, events=None,
                                   wandb=None, metrics=None)  # fmt: skip
    assert greedy_warnings() == []
