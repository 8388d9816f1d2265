"""The build as a Ray job: a real two-node cluster with `ray job submit` and token auth, a worker
killed mid-build, an interrupted driver resumed, failures that stay contained, the scheduler at
scale with a synthetic builder, and cluster.yaml checked by Ray's own validation.

Model-free mechanics use a tiny random Llama saved with the real SmolLM2 tokenizer; clustering
uses the real MiniLM. Every Ray process a test starts is stopped by pid (never `ray stop`, which
would also stop the session's `ray_local` and anyone else's Ray on the machine).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from jobs import build
from lab.rehearsal import SYNTHETIC_CONFIG, SYNTHETIC_STAGES, write_synthetic_corpus
from pipeline.builder.driver import run_build
from pipeline.config import DriverOptions, ModelFingerprints
from pipeline.corpus.reader import write_jsonl
from pipeline.corpus.synthetic import make_corpus
from pipeline.kv import models
from pipeline.store.backends.base import Store, cache_key
from pipeline.store.backends.local import LocalStore
from pipeline.store.backends.uri import open_store
from pipeline.store.catalogue.manifest import list_conversations, read_manifest
from pipeline.store.objects import cache_format
from tests.support.paths import REPO
from tests.support.s3_server import free_ports

PY = sys.executable
VENV_BIN = str(Path(sys.executable).parent)
SMALL = ["--budget", "64", "--block", "64", "--medoids", "1", "--episodes", "2",
         "--calibration-tokens", "512", "--calibration-window", "128", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> str:
    """A tiny random Llama with the real SmolLM2 tokenizer, saved as a local model folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = models.load_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llm")
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def corpus_file(folder: Path, n: int, seed: int) -> Path:
    path = folder / "corpus.jsonl"
    write_jsonl(make_corpus(n, 900, seed=seed), path)
    return path


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment without a Ray address (a build here starts its own local Ray)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return env | {"PYTHONUNBUFFERED": "1"} | extra


def verify_store(store: Store, expected: set[str]) -> list[dict]:
    """Every manifest names complete objects whose checksums verify; returns all rows."""
    assert set(list_conversations(store)) == expected
    rows = []
    for cid in expected:
        for row in read_manifest(store, cid):
            data = store.get(row.object_key)
            assert len(data) == row.object_bytes
            cache_format.deserialize(data, row.sha256, row.object_key)  # raises if corrupt
            rows.append(row)
    return rows


def stop_processes(procs: list[psutil.Process], timeout: float = 15) -> list[int]:
    """Terminate, then kill, whichever of `procs` still run; returns the pids that did."""
    alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(alive, timeout=timeout)
    for p in still:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in alive]


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


# ---------------------------------------------------------------------------------------------
# cluster.yaml
# ---------------------------------------------------------------------------------------------

def test_cluster_yaml_passes_rays_validation():
    """The launcher config is what `ray up` accepts: Ray's schema, after Ray fills defaults."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((REPO / "cluster.yaml").read_text())
    config = prepare_config(raw)
    validate_config(config)
    nodes = config["available_node_types"]
    head, gpu = nodes[config["head_node_type"]], nodes["gpu_worker"]
    assert "GPU" not in head["resources"] and gpu["resources"]["GPU"] >= 1
    assert 0 <= gpu["min_workers"] < gpu["max_workers"] <= config["max_workers"]
    text = (REPO / "cluster.yaml").read_text()
    assert "ray job submit" in text and "jobs.build" in text
    assert not re.search(r"AWS_SECRET_ACCESS_KEY\s*[=:]|aws_secret_access_key", text)
    # GPU workers get a CUDA torch before the pinned requirements (which pin the CPU build)
    worker_setup = " ".join(config["worker_setup_commands"])
    assert "whl/cu" in worker_setup and "grep -v '^torch=='" in worker_setup
    assert worker_setup.index("whl/cu") < worker_setup.index("requirements-no-torch")


# ---------------------------------------------------------------------------------------------
# A two-node cluster on this machine, the build submitted with `ray job submit`
# ---------------------------------------------------------------------------------------------

class TwoNodeCluster:
    """`ray start --head` plus a second `ray start --address`, each with --block so that its
    own SIGTERM stops exactly its node's processes; both share a private temp dir."""

    def __init__(self, env: dict[str, str]):
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: socket paths
        self.env = env
        (self.gcs, self.dashboard, self.agent1, self.agent2,
         self.client_port) = free_ports(5)
        self.address = f"http://127.0.0.1:{self.dashboard}"
        ray = [str(Path(VENV_BIN) / "ray"), "start", "--block", "--num-cpus=1",
               f"--temp-dir={self.temp_dir}", "--disable-usage-stats"]
        self.head = self._start(ray + ["--head", f"--port={self.gcs}", "--dashboard-host=127.0.0.1",
                                       f"--dashboard-port={self.dashboard}",
                                       f"--dashboard-agent-listen-port={self.agent1}",
                                       f"--ray-client-server-port={self.client_port}"], "head")
        self._wait_started("head")
        self.worker = self._start(ray + [f"--address=127.0.0.1:{self.gcs}",
                                         f"--dashboard-agent-listen-port={self.agent2}"], "worker")
        self._wait_started("worker")

    def _start(self, args: list[str], name: str) -> subprocess.Popen:
        log = open(self.temp_dir / f"{name}.log", "wb")
        proc = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        log.close()
        return proc

    def _wait_started(self, name: str, timeout: float = 120) -> None:
        log = self.temp_dir / f"{name}.log"
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in log.read_text(errors="replace"):
            proc = self.head if name == "head" else self.worker
            if proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ray {name} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster: the two `ray start`s, everything under them, and
        whatever names the private temp dir (GCS, raylets, agents)."""
        found = {}
        for top in (self.head, getattr(self, "worker", None)):
            if top is not None and top.poll() is None:
                found[top.pid] = psutil.Process(top.pid)
                found.update({p.pid: p for p in descendants(top.pid)})
        for p in psutil.process_iter(["cmdline"]):
            if str(self.temp_dir) in " ".join(p.info["cmdline"] or []):
                found[p.pid] = p
                for c in descendants(p.pid):
                    found[c.pid] = c
        return list(found.values())

    def stop(self) -> None:
        before = self.processes()
        for top in (getattr(self, "worker", None), self.head):  # worker first, then head
            if top is not None and top.poll() is None:
                top.send_signal(signal.SIGTERM)
                try:
                    top.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    top.kill()
        stop_processes(before, timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture
def two_node_cluster(s3_server, tmp_path):
    """Nodes whose environment holds the S3 credentials (as an instance role would provide),
    token authentication with a token file of this test's own."""
    from ray._private.authentication.authentication_token_generator import (
        generate_new_authentication_token,
    )

    token = tmp_path / "auth_token"
    token.write_text(generate_new_authentication_token())
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env = subprocess_env(**auth, **s3_server.env(),
                         PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    cluster = TwoNodeCluster(env)
    cluster.client_env = subprocess_env(**auth)  # the submitting client: no AWS credentials
    try:
        yield cluster
    finally:
        cluster.stop()
        assert not [p for p in cluster.processes() if p.is_running()
                    and p.status() != psutil.STATUS_ZOMBIE], "cluster processes left running"


@pytest.mark.e2e
def test_two_node_build_submitted_with_ray_job_submit(two_node_cluster, s3_server, s3_env,
                                                      tiny_llm, tmp_path):
    """`ray job submit --working-dir . -- python -m jobs.build` on a two-node cluster with token
    auth: the corpus is read from S3, caches and manifests land in S3, tasks ran on both nodes
    (node ids in the manifest rows), and a client without the token is refused."""
    cluster = two_node_cluster
    corpus = corpus_file(tmp_path, 4, seed=21)
    s3_server.client().upload_file(str(corpus), s3_server.bucket, "twonode/in/corpus.jsonl")
    store_uri = s3_server.uri("twonode/store")
    cmd = [str(Path(VENV_BIN) / "ray"), "job", "submit", "--address", cluster.address,
           "--working-dir", str(REPO), "--", "python", "-m", "jobs.build",
           "--corpus", s3_server.uri("twonode/in/corpus.jsonl"), "--store", store_uri,
           "--s3-endpoint", s3_server.endpoint, "--model", tiny_llm, "--max-in-flight", "4",
           *SMALL]
    out = subprocess.run(cmd, env=cluster.client_env, cwd=REPO, capture_output=True, text=True,
                         timeout=480)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    summary = [ln for ln in log.splitlines() if ln.startswith("built ")]
    assert summary, log[-4000:]
    print("\ntwo-node summary:", summary[-1])
    assert "built 4 conversations" in summary[-1] and "failed 0" in summary[-1]
    assert "on 2 nodes" in summary[-1]
    assert s3_server.secret_key not in log

    store = open_store(store_uri)
    rows = verify_store(store, {f"synth-{i:04d}" for i in range(4)})
    nodes = {r.node_id for r in rows}
    assert len(nodes) == 2 and all(re.fullmatch(r"[0-9a-f]{56}", n) for n in nodes), nodes
    assert all(re.fullmatch(r".+:\d+", r.worker) for r in rows)

    refused = subprocess.run([str(Path(VENV_BIN) / "ray"), "job", "list", "--address",
                              cluster.address], env=subprocess_env(RAY_AUTH_MODE="disabled",
                                                                   RAY_AUTH_TOKEN_PATH="/nonexistent"),
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    assert "auth" in (refused.stdout + refused.stderr).lower()


# ---------------------------------------------------------------------------------------------
# Failures of a running build
# ---------------------------------------------------------------------------------------------

class EpisodeKiller(threading.Thread):
    """Watches the processes under `pid` and SIGKILLs the first one running an episode task."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.killed, self.title = pid, None, ""
        self.done = threading.Event()

    def run(self) -> None:
        while self.killed is None and not self.done.is_set():
            for p in descendants(self.pid):
                try:
                    title = " ".join(p.cmdline())
                    if title.startswith("ray::episode_task"):
                        p.kill()
                        self.killed, self.title = p.pid, title
                        return
                except psutil.Error:
                    continue
            time.sleep(0.01)


@pytest.mark.e2e
def test_worker_killed_mid_build_does_not_stop_the_job(ray_local, tiny_llm, tmp_path):
    """SIGKILL a Ray worker while it runs an episode task: Ray retries the task, the build
    completes with every conversation, and every manifest names complete objects whose
    checksums verify."""
    corpus, store_dir = corpus_file(tmp_path, 6, seed=31), tmp_path / "store"
    args = ["--corpus", str(corpus), "--store", str(store_dir), "--model", tiny_llm,
            "--max-retries", "2", "--max-in-flight", "4", *SMALL]
    killer = EpisodeKiller(os.getpid())  # this session's local Ray runs under this process
    killer.start()
    try:
        summary = run_build(str(corpus), str(store_dir),
                            build.config_from_args(build.parse_args(args)),
                            DriverOptions(max_in_flight=4, max_retries=2, progress=False))
    finally:
        killer.done.set()
        killer.join()
    assert killer.killed is not None, "never saw an episode task running"
    assert not psutil.pid_exists(killer.killed) or \
        psutil.Process(killer.killed).status() == psutil.STATUS_ZOMBIE
    assert (summary.built, summary.failed) == (6, {}), summary.failed
    assert summary.episodes == 12
    verify_store(LocalStore(store_dir), {f"synth-{i:04d}" for i in range(6)})


@pytest.mark.e2e
def test_interrupted_driver_resumes_without_rebuilding(ray_local, tiny_llm, tmp_path, capsys):
    """SIGINT a `python -m jobs.build` once its first manifest is committed: it exits 130 with
    one line and leaves no Ray process behind. Running the same command again builds only the
    rest: finished conversations are skipped, their manifests and objects untouched."""
    n = 8
    corpus, store_dir = corpus_file(tmp_path, n, seed=41), tmp_path / "store"
    args = ["--corpus", str(corpus), "--store", str(store_dir), "--model", tiny_llm,
            "--max-in-flight", "2", *SMALL]
    # A shell starts background commands with SIGINT ignored, and a child that inherits that
    # never gets Python's KeyboardInterrupt handler: give the driver the default disposition
    # whatever launched pytest (a caught signal resets to the default at exec).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([PY, "-m", "jobs.build", *args], cwd=REPO, env=subprocess_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    manifests = store_dir / "manifests"
    tree: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 300
        while not list(manifests.glob("*.parquet")) and proc.poll() is None \
                and time.monotonic() < deadline:
            tree.update({p.pid: p for p in descendants(proc.pid)})
            time.sleep(0.02)
        tree.update({p.pid: p for p in descendants(proc.pid)})
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert stderr.splitlines()[-1].startswith("interrupted:")
    _, left = psutil.wait_procs([p for p in tree.values() if p.is_running()], timeout=30)
    leftover = stop_processes(left, timeout=5)
    assert not leftover, f"Ray processes outlived the interrupted driver: {leftover}"

    def snapshot() -> dict[str, tuple[bytes, int]]:
        return {str(p.relative_to(store_dir)): (p.read_bytes(), p.stat().st_mtime_ns)
                for p in store_dir.rglob("*") if p.is_file() and not p.name.startswith(".tmp-")}

    store = LocalStore(store_dir)
    done = set(list_conversations(store))
    assert 1 <= len(done) < n, f"{len(done)} of {n} built before the interrupt landed"
    committed = {}
    for cid in done:
        keys = [f"manifests/{cid}.parquet"] + [r.object_key for r in read_manifest(store, cid)]
        committed.update({k: v for k, v in snapshot().items() if k in keys})

    assert build.main(args) == 0  # the same command again (on this session's Ray)
    out = capsys.readouterr().out
    assert f"built {n - len(done)} conversations" in out, out
    assert f"skipped {len(done)} up to date" in out, out
    after = snapshot()
    assert {k: after[k] for k in committed} == committed  # same bytes, never rewritten
    verify_store(store, {f"synth-{i:04d}" for i in range(n)})


@pytest.mark.e2e
def test_failing_episode_fails_its_conversation_and_the_rest_completes(ray_local, tiny_llm,
                                                                       tmp_path, capsys):
    """A real, persistent failure (the folder of a conversation's objects blocked by a file):
    its conversation is reported failed with the error, no manifest names it, every other
    conversation is built, and the command exits 1."""
    corpus, store_dir = corpus_file(tmp_path, 3, seed=51), tmp_path / "store"
    args = ["--corpus", str(corpus), "--store", str(store_dir), "--model", tiny_llm,
            "--max-in-flight", "3", *SMALL]
    config = build.config_from_args(build.parse_args(args))
    files = ModelFingerprints(models.llm_fingerprint(tiny_llm),
                              models.encoder_fingerprint(config.encoder))
    # objects are named by their content: block the folder they all go in
    blocked = store_dir / cache_key("synth-0001", files.bound_hash(config.hash), 1)
    blocked.parent.parent.mkdir(parents=True)
    blocked.parent.write_text("a file where the episodes' folder should go")

    code = build.main(args)
    out, err = capsys.readouterr()
    assert code == 1
    assert "built 2 conversations" in out and "failed 1" in out, out
    failed = [ln for ln in err.splitlines() if ln.startswith("failed ")]
    assert len(failed) == 1 and re.match(r"failed synth-0001: episode \d: ", failed[0]), err
    assert "Error" in failed[0]
    store = LocalStore(store_dir)
    verify_store(store, {"synth-0000", "synth-0002"})


def test_worker_deaths_are_retried_a_bounded_number_of_times(ray_local, tmp_path):
    """Synthetic stages on the real scheduler: a conversation whose worker always dies fails
    after Ray's bounded retries, one whose episode raises fails at once, the others commit;
    the driver never has more tasks submitted than its bound."""
    corpus = tmp_path / "corpus.jsonl"
    write_synthetic_corpus(corpus, 8, failures={2: "crash", 5: "raise"})
    store = LocalStore(tmp_path / "store")
    summary = run_build(str(corpus), store, SYNTHETIC_CONFIG,
                        DriverOptions(max_in_flight=3, max_retries=1, progress=False),
                        stages=SYNTHETIC_STAGES)
    assert summary.built == 6 and set(summary.failed) == {"bench-0000002", "bench-0000005"}
    assert "WorkerCrashedError" in summary.failed["bench-0000002"]
    assert "RuntimeError: rehearsed failure of bench-0000005" in summary.failed["bench-0000005"]
    assert summary.peak_in_flight <= 3
    built = {f"bench-{i:07d}" for i in range(8)} - set(summary.failed)
    verify_store(store, built)
