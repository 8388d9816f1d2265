"""The question-time top-up's serve settings: `jobs.serve --topup/--no-topup --topup-turns
--topup-max-tokens` and `serve run ... topup=true topup_turns=N`, read from the same
`ServeSettings` fields (a bool field works both ways, whatever its default), and what a client
is shown of a top-up."""

from __future__ import annotations

import argparse

import pytest

from jobs.serve import parse_args, settings_from_args
from pipeline.answer.topup import TopUp
from pipeline.cli.options import FieldOption
from pipeline.config import TopUpConfig
from pipeline.serve.ingress import UNUSABLE_INDEX, public_topup
from pipeline.serve.settings import ServeSettings
from pipeline.store.objects.turn_index import StoredIndex

STORE = ["--store", "no-such-store"]


def test_the_command_line_sets_the_topup_both_ways():
    def config(*extra: str) -> TopUpConfig:
        return settings_from_args(parse_args([*STORE, *extra])).topup_config

    assert config() == TopUpConfig()
    assert config("--topup", "--topup-turns", "6", "--topup-max-tokens", "128") == \
        TopUpConfig(enabled=True, turns=6, max_tokens=128)
    assert config("--topup", "--no-topup").enabled is False
    assert config("--topup-skip-held").skip_held is True
    assert config("--topup-read-once").read_once is True and config().read_once is False
    with pytest.raises(ValueError, match="needs skip_held"):  # compares with the skipped turns
        config("--topup-nearer-than-held")


def test_serve_run_keys_set_the_topup_both_ways():
    def config(**args: str) -> TopUpConfig:
        return ServeSettings.from_strings({"store": "s", **args}).topup_config

    assert config() == TopUpConfig()
    assert config(topup="true", topup_turns="2", topup_max_tokens="32") == \
        TopUpConfig(enabled=True, turns=2, max_tokens=32)
    assert config(topup="false").enabled is False and config(topup="on").enabled is True
    assert config(topup_read_once="true").read_once is True
    with pytest.raises(ValueError, match="not a boolean"):
        config(topup="maybe")


@pytest.mark.parametrize("key, value", [("topup_turns", "-1"), ("topup_max_tokens", "0")])
def test_a_topup_bound_below_one_is_refused(key, value, capsys):
    with pytest.raises(ValueError, match=key):
        ServeSettings.from_strings({"store": "s", key: value})
    import jobs.serve

    assert jobs.serve.main([*STORE, "--" + key.replace("_", "-"), value]) == 2
    assert key in capsys.readouterr().err


def test_topup_turns_0_reads_as_many_turns_as_the_tokens_hold():
    assert ServeSettings.from_strings({"store": "s", "topup_turns": "0"}).topup_config.turns \
        is None
    assert settings_from_args(parse_args([*STORE, "--topup-turns", "0"])).topup_config.turns \
        is None


@pytest.mark.parametrize("default", [False, True])
def test_a_bool_field_is_an_option_pair_whatever_its_default(default):
    p = argparse.ArgumentParser()
    FieldOption("--topup", "enabled", "top up").add_to(p, TopUpConfig(enabled=default))
    assert p.parse_args([]).topup is default
    assert p.parse_args(["--topup"]).topup is True
    assert p.parse_args(["--no-topup"]).topup is False
    assert f"(default: {'on' if default else 'off'})" in p.format_help()


def _records(stored: StoredIndex | None):
    from types import SimpleNamespace

    return [SimpleNamespace(turn_index=stored)]


def test_a_client_sees_the_topups_turns_not_its_text_nor_the_index_objects_key():
    used = TopUp("\n\nSession 2\nAnna: the kitten is Miso.", ("D2:4",), 14, "used",
                 hidden_spans=((120, 134),))  # the decoder's business, not the client's
    stored = StoredIndex("turns/synth-0000/0123456789abcdef/index-fedcba.safetensors", "ab", 9)
    assert public_topup(used, _records(stored)) == {
        "turn_ids": ["D2:4"], "tokens": 14, "status": "used", "note": ""}
    # the library's note names the object: the client gets the fixed one, with the repair
    broken = TopUp.unavailable(f"turn index {stored.key} failed its checksum; rebuild it")
    shown = public_topup(broken, _records(stored))
    assert shown["status"] == "unavailable" and shown["note"] == UNUSABLE_INDEX
    assert "turns/" not in shown["note"] and "python -m jobs.build (" in shown["note"]
    assert "--force" not in shown["note"] and "--verify" in shown["note"]  # a re-run repairs it
    # a conversation built before turn indexes: the library's note names only the conversation
    old = TopUp.unavailable("conversation 'synth-0000' was built before turn indexes: ...")
    assert public_topup(old, _records(None))["note"] == old.note
