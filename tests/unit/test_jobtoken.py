"""The job token: explicit variables win; otherwise a private per-user secret, keyed by the job."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import stat

import pytest

from rdkeras import jobtoken, options


@pytest.fixture
def home(tmp_path):
    """Settings of an environment whose config folder is empty (XDG_CONFIG_HOME points into tmp)."""
    return options.from_env({"XDG_CONFIG_HOME": str(tmp_path / "config")})


def test_the_variables_are_read_into_the_settings(home):
    settings = options.from_env({"RDKERAS_JOB_TOKEN": "abc", "RDKERAS_JOB_TOKEN_FILE": "/run/secret"})
    assert (settings.job_token, settings.job_token_file) == ("abc", "/run/secret")


def test_the_variable_wins(home):
    assert jobtoken.resolve(4, "slurm|1|0", dataclasses.replace(home, job_token="abc")) == b"abc"
    assert not jobtoken.secret_path(home).exists()


def test_a_token_file_as_a_kubernetes_secret(home, tmp_path):
    secret = tmp_path / "mounted-token"
    secret.write_text("from-a-secret\n")
    secret.chmod(0o600)
    assert jobtoken.resolve(2, None, dataclasses.replace(home, job_token_file=str(secret))) == b"from-a-secret"
    secret.chmod(0o644)
    with pytest.raises(jobtoken.TokenError, match=r"open to other users \(mode 0644\).*chmod 600"):
        jobtoken.resolve(2, None, dataclasses.replace(home, job_token_file=str(secret)))


def test_the_user_secret_is_created_private_on_first_use(home):
    token = jobtoken.resolve(2, "slurm|c|42|0", home)
    path = jobtoken.secret_path(home)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(path.read_text().strip()) == 2 * jobtoken.SECRET_BYTES
    assert [p.name for p in path.parent.iterdir()] == ["job-token"]  # no temporary file left
    # Every rank of the job computes the same token; another job, or another user's secret, does not.
    assert jobtoken.resolve(2, "slurm|c|42|0", home) == token
    assert jobtoken.resolve(2, "slurm|c|43|0", home) != token
    assert path.read_text().strip().encode() not in token  # the secret itself never is the token


def test_another_users_secret_gives_another_token(home, tmp_path):
    other = options.from_env({"XDG_CONFIG_HOME": str(tmp_path / "other")})
    assert jobtoken.resolve(2, "job", home) != jobtoken.resolve(2, "job", other)


def test_a_readable_secret_file_is_refused_with_what_to_do(home):
    jobtoken.resolve(2, "job", home)
    path = jobtoken.secret_path(home)
    path.chmod(0o640)
    with pytest.raises(jobtoken.TokenError, match=rf"{path} is open to other users \(mode 0640\).*chmod 600 {path}"):
        jobtoken.resolve(2, "job", home)


def test_a_symlinked_secret_is_refused(home, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("x" * 64)
    target.chmod(0o600)
    path = jobtoken.secret_path(home)
    path.parent.mkdir(parents=True)
    path.symlink_to(target)
    with pytest.raises(jobtoken.TokenError, match=r"job-token file .* is a symbolic link: use the file it points to"):
        jobtoken.resolve(2, "job", home)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_token_path_that_is_not_a_file_is_refused_at_once(home, tmp_path, kind):
    token = tmp_path / "private" / "token"
    token.parent.mkdir(mode=0o700)
    os.mkfifo(token, 0o600) if kind == "fifo" else token.mkdir(mode=0o700)
    settings = dataclasses.replace(home, job_token_file=str(token))
    expected = "a FIFO" if kind == "fifo" else "a directory"
    # A FIFO would block open() until a writer came: it must be refused, not read (the timeout proves it).
    with pytest.raises(jobtoken.TokenError, match=rf"is {expected}: it must be a regular file"):
        _within(5, jobtoken.resolve, 2, None, settings)


def test_a_token_in_a_folder_others_can_write_is_refused(home, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    token = shared / "token"
    token.write_text("planted-by-someone")
    token.chmod(0o600)
    with pytest.raises(jobtoken.TokenError, match=r"in .*shared, which others can write .*mode 0777.*chmod go-w"):
        jobtoken.resolve(2, None, dataclasses.replace(home, job_token_file=str(token)))


def _within(seconds: float, fn, *args):
    """fn(*args) in a daemon thread (left behind if it hangs); fails the test if it has not returned in time."""
    import threading

    outcome: list = []

    def call():
        try:
            outcome.append((True, fn(*args)))
        except BaseException as e:
            outcome.append((False, e))

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"{fn.__name__} did not return within {seconds} s"
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _token_file(tmp_path, content: bytes):
    token = tmp_path / "private" / "token"
    token.parent.mkdir(mode=0o700, exist_ok=True)
    token.write_bytes(content)
    token.chmod(0o600)
    return token


def test_a_token_file_is_read_in_linear_time_up_to_its_cap(home, tmp_path, monkeypatch):
    # The file as the largest a token file may be, delivered a few bytes a read (as a slow mount might): one buffer
    # grows, instead of a bytes object copied whole at every read (a 20 MB file took 64 s that way).
    content = b"t" * (jobtoken.MAX_TOKEN_FILE_BYTES - 1) + b"\n"
    settings = dataclasses.replace(home, job_token_file=str(_token_file(tmp_path, content)))
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: real_read(fd, min(n, 7)))
    assert _within(5, jobtoken.resolve, 2, None, settings) == content.strip()


def test_a_token_file_past_the_cap_is_refused_at_once_saying_what_it_holds(home, tmp_path):
    token = _token_file(tmp_path, b"x" * (20 << 20))
    settings = dataclasses.replace(home, job_token_file=str(token))
    with pytest.raises(jobtoken.TokenError) as e:
        _within(1, jobtoken.resolve, 2, None, settings)
    assert str(e.value) == (
        f"the RDKERAS_JOB_TOKEN_FILE file {token} holds 20,971,520 bytes, more than a token file may (65,536): it "
        "must hold the token alone (rdkeras writes 64 hex characters); check that it is the right file"
    )


def test_a_token_file_that_grows_while_read_is_read_no_further_than_the_cap(home, tmp_path, monkeypatch):
    token = _token_file(tmp_path, b"y" * (jobtoken.MAX_TOKEN_FILE_BYTES + 100))
    real_fstat = os.fstat

    def small(fd):  # the size when it was opened; more came after
        st = real_fstat(fd)
        return os.stat_result((*st[:6], 10, *st[7:]))

    monkeypatch.setattr(os, "fstat", small)
    with pytest.raises(jobtoken.TokenError, match=r"holds 65,537 bytes, more than a token file may \(65,536\)"):
        jobtoken.resolve(2, None, dataclasses.replace(home, job_token_file=str(token)))


def test_one_rank_needs_no_secret_and_no_job_means_a_clear_error(home):
    assert len(jobtoken.resolve(1, None, home)) == 32
    with pytest.raises(jobtoken.TokenError, match="no job token: set RDKERAS_JOB_TOKEN"):
        jobtoken.resolve(2, None, home)
    assert not jobtoken.secret_path(home).exists()


def _race(settings: options.Options, queue) -> None:
    queue.put(jobtoken.resolve(8, "race", settings))


def test_ranks_creating_the_secret_at_once_agree(home):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(home, queue)) for _ in range(8)]
    for p in procs:
        p.start()
    tokens = {queue.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(tokens) == 1
    assert len(os.listdir(jobtoken.secret_path(home).parent)) == 1
