"""The job's secret: made once per run directory (0600, 256 bits), a user's own file, the bearer
check's three answers, SGLang's key levels, paths kept inside the job, the peer proof."""

from __future__ import annotations

import base64
import os
import stat

import pytest

from dora_megatron.comm import auth


def test_a_job_secret_is_made_once_private_and_of_256_bits(tmp_path):
    first = auth.job_secret(tmp_path)
    path = tmp_path / auth.SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(base64.urlsafe_b64decode(first + "=" * (-len(first) % 4))) * 8 >= 256
    assert auth.job_secret(tmp_path) == first  # --resume / --join read the same one
    assert [p.name for p in tmp_path.iterdir()] == [auth.SECRET_FILE]  # no temporary file left behind
    path.unlink()  # rotation between resumes: delete it, the next start makes a new one
    assert auth.job_secret(tmp_path) != first


def test_a_users_secret_file_is_used_and_refused_when_others_can_read_it(tmp_path):
    own = tmp_path / "mine"
    own.write_text("x" * 40 + "\n")
    own.chmod(0o600)
    assert auth.job_secret(tmp_path / "run", str(own)) == "x" * 40
    own.chmod(0o644)
    with pytest.raises(auth.SecretError, match=r"readable by others \(mode 644\); chmod 600"):
        auth.job_secret(tmp_path / "run", str(own))
    own.chmod(0o600)
    own.write_text("short")
    with pytest.raises(auth.SecretError, match="at least 32 characters"):
        auth.job_secret(tmp_path / "run", str(own))
    with pytest.raises(auth.SecretError, match="cannot read the job secret"):
        auth.job_secret(tmp_path / "run", str(tmp_path / "missing"))
    own.write_text("-" + "x" * 40)  # SGLang's parser would take `--api-key -xxx` for two flags
    with pytest.raises(auth.SecretError, match="not starting with '-'"):
        auth.job_secret(tmp_path / "run", str(own))


def test_a_made_secret_never_starts_with_a_dash(monkeypatch, tmp_path):
    """One token in 64 starts with '-'; such a draw is thrown away, not used."""
    draws = iter(["-" + "a" * 42, "-" + "b" * 42, "c" * 43])
    monkeypatch.setattr(auth.secrets, "token_urlsafe", lambda n: next(draws))
    assert auth.job_secret(tmp_path) == "c" * 43


def test_the_job_environment_is_set_while_the_job_runs_and_restored_after(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.setenv(auth.VLLM_KEY_ENV, "someone-elses")
    tmp_path.chmod(0o755)
    with auth.job_environment(tmp_path) as secret:
        assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700  # weights and SGLang's log: the user's only
        assert os.environ[auth.SECRET_ENV] == secret == os.environ[auth.VLLM_KEY_ENV]
        assert os.environ[auth.WEIGHTS_ROOT_ENV] == str(tmp_path.resolve() / "weights")
        keys = tmp_path / auth.SGLANG_KEYS_FILE
        assert stat.S_IMODE(keys.stat().st_mode) == 0o600
        assert keys.read_text() == f"api-key: {secret}\nadmin-api-key: {secret}\n"  # flag names (--config)
        assert auth.sglang_config_args() == ["--config", str(tmp_path.resolve() / auth.SGLANG_KEYS_FILE)]
    assert auth.SECRET_ENV not in os.environ and auth.sglang_config_args() == []
    assert os.environ[auth.VLLM_KEY_ENV] == "someone-elses"


def test_the_bearer_check_answers_401_without_and_403_with_a_wrong_credential():
    key = "k" * 43
    assert auth.check(f"Bearer {key}", key) is None
    assert auth.check(f"bearer {key}", key) is None
    assert auth.check(None, key) == 401
    assert auth.check("", key) == 401
    assert auth.check(f"Basic {key}", key) == 401
    assert auth.check("Bearer ", key) == 401
    assert auth.check("Bearer " + "k" * 42, key) == 403
    assert auth.check("Bearer " + key + "k", key) == 403
    assert auth.check("Bearer é", key) == 403  # non-ASCII offered values are compared, not crashed on


def test_key_levels_follow_sglang_0_5_23():
    only_api, both, only_admin = auth.Keys("A", None), auth.Keys("A", "B"), auth.Keys(None, "B")
    bearer = lambda k: f"Bearer {k}"  # noqa: E731
    assert only_api.decide("/generate", False, bearer("A")) is None
    assert only_api.decide("/pause_generation", True, bearer("A")) is None  # admin falls back to api_key
    assert both.decide("/pause_generation", True, bearer("A")) == 403  # api_key no longer opens admin routes
    assert both.decide("/pause_generation", True, bearer("B")) is None
    assert both.decide("/generate", False, bearer("B")) == 403  # nor the admin key normal ones
    assert only_admin.decide("/generate", False, None) is None  # no api_key: normal routes open
    assert only_admin.decide("/flush_cache", True, None) == 401
    for keys in (only_api, both, only_admin):
        assert keys.decide("/health", True, None) is None
    assert auth.Keys().decide("/dora/export_request", True, None) is None  # no keys: no check (outside a job)


def test_keys_of_a_job_come_from_the_environment_unless_given():
    env = {auth.SECRET_ENV: "S" * 43}
    assert auth.Keys.of_job(env=env) == auth.Keys("S" * 43, "S" * 43)
    assert auth.Keys.of_job("A", None, env=env) == auth.Keys("A", None)
    assert auth.Keys.of_job(env={}) == auth.Keys(None, None)


def test_paths_stay_inside_the_job(tmp_path):
    run = tmp_path / "run"
    (run / "weights" / "v000001").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    assert auth.inside(run / "weights" / "v000001", [run], "rule") == (run / "weights" / "v000001").resolve()
    for outside in (tmp_path / "elsewhere", run / ".." / "elsewhere", "/etc", tmp_path / "run2"):
        with pytest.raises(auth.OutsideJob, match="refused: checkpoints stay in the run directory"):
            auth.inside(outside, [run], "checkpoints stay in the run directory")
    (run / "link").symlink_to(tmp_path / "elsewhere")  # a symlink inside pointing out is outside
    with pytest.raises(auth.OutsideJob):
        auth.inside(run / "link", [run], "rule")

