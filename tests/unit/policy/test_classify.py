"""Glob semantics, class and tenant selection, /proc job lookups and their cache."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from qosfs.policy.classify import Classifier, JobCache, JobInfo, final_name, read_job_info
from qosfs.policy.globs import GlobError, compile_cgroup_glob, compile_glob, compile_value_glob
from qosfs.policy.loading import default_policy, parse_policy, policy_notes

GLOBS = [
    ("data/**", "data", True),
    ("data/**", "data/a", True),
    ("data/**", "data/a/b", True),
    ("data/**", "datax", False),
    ("data/**", "x/data/a", False),
    ("**/*.pt", "x.pt", True),
    ("**/*.pt", "a/b/x.pt", True),
    ("**/*.pt", "a/x.ptx", False),
    ("**/*.pt", "a/x.pt/y", False),
    ("**/checkpoints/**", "checkpoints", True),
    ("**/checkpoints/**", "checkpoints/x", True),
    ("**/checkpoints/**", "a/checkpoints/b/c", True),
    ("**/checkpoints/**", "a/mycheckpoints/b", False),
    ("a/**/b", "a/b", True),
    ("a/**/b", "a/x/y/b", True),
    ("a/**/b", "ab", False),
    ("a/**/**/b", "a/b", True),
    ("**", "", True),
    ("**", "a/b/c", True),
    ("*", "a", True),
    ("*", "a/b", False),
    ("*.parquet", "x.parquet", True),
    ("*.parquet", "d/x.parquet", False),
    ("shard-??.tar", "shard-07.tar", True),
    ("shard-??.tar", "shard-7.tar", False),
    ("x?", "x/", False),
    ("[ab]*", "a1", True),
    ("[ab]*", "c1", False),
    ("[!ab]*", "c1", True),
    ("[^ab]*", "a1", False),
    ("v[0-9]", "v7", True),
    ("v[0-9]", "vx", False),
    ("[]]x", "]x", True),
    ("[!]]x", "ax", True),
    ("a[.]b", "a.b", True),
    ("a.b", "axb", False),
    ("a+b(c)", "a+b(c)", True),
    ("x\\y", "x\\y", True),
    ("*.pt", "we\nird.pt", True),
    ("[[]x", "[x", True),
    ("[a&&b]", "&", True),
]


@pytest.mark.parametrize(("pattern", "path", "matches"), GLOBS)
def test_glob(pattern: str, path: str, matches: bool) -> None:
    assert (compile_glob(pattern).fullmatch(path) is not None) is matches


@pytest.mark.parametrize(("pattern", "message"), [
    ("", 'invalid glob "": empty pattern'),
    ("/data/**", 'invalid glob "/data/**": must be relative to the mount root (no leading "/")'),
    ("a//b", 'invalid glob "a//b": empty path component'),
    ("a/", 'invalid glob "a/": empty path component'),
    ("a/../b", 'invalid glob "a/../b": ".." component never matches (paths are normalized)'),
    ("./a", 'invalid glob "./a": "." component never matches (paths are normalized)'),
    ("a**", ('invalid glob "a**": "**" must be a whole path component, like "data/**" or '
             '"**/*.pt"')),
    ("[ab", 'invalid glob "[ab": unbalanced "["'),
    ("[]", 'invalid glob "[]": unbalanced "["'),
    ("x[a/b]", 'invalid glob "x[a/b]": unbalanced "["'),
    ("[z-a]", 'invalid glob "[z-a]": range "z-a" is backwards'),
])
def test_glob_rejects(pattern: str, message: str) -> None:
    with pytest.raises(GlobError, match=f"^{re.escape(message)}$"):
        compile_glob(pattern)


def test_value_and_cgroup_globs() -> None:
    assert compile_value_glob("55*").fullmatch("5501")
    assert compile_value_glob("*").fullmatch("a/b")
    assert not compile_value_glob("1234").fullmatch("12345")
    cg = compile_cgroup_glob("/slurm/uid_*/job_*/**")
    assert cg.fullmatch("slurm/uid_1000/job_7")
    assert cg.fullmatch("slurm/uid_1000/job_7/step_0/user/task_0")
    assert not cg.fullmatch("system.slice/sshd.service")
    with pytest.raises(GlobError, match="cgroup paths are absolute"):
        compile_cgroup_glob("slurm/**")
    with pytest.raises(GlobError, match=r'^invalid glob "/": empty pattern$'):
        compile_cgroup_glob("/")


POLICY = """\
[tenants.team-a]
uids = ["1000-1999"]
gids = [500]
[tenants.shared]
paths = ["shared/**"]
[classes.slurm-hot]
job_env = "SLURM_JOB_ID"
jobs = ["55*"]
[classes.any-job]
job_env = "SLURM_JOB_ID"
ops = ["write"]
[classes.batch]
cgroups = ["/batch.slice/**"]
[classes.team-a-ckpt]
tenants = ["team-a"]
paths = ["**/checkpoints/**"]
[classes.shared]
tenants = ["shared"]
[classes.ckpt]
paths = ["**/checkpoints/**", "**/*.pt"]
ops = ["write", "meta"]
[classes.alice-data]
paths = ["data/**"]
uids = [7]
gids = ["100-199"]
[classes.data]
paths = ["data/**"]
"""


@pytest.fixture
def classifier() -> Classifier:
    return Classifier(parse_policy(POLICY))


def _slurm(job_id: str) -> tuple[tuple[str, str], ...]:
    return (("SLURM_JOB_ID", job_id),)


@pytest.mark.parametrize(("path", "uid", "gid", "op", "job", "expected"), [
    ("x/checkpoints/step1", 1000, 1, "write", None, "team-a-ckpt"),
    ("x/checkpoints/step1", 1, 500, "read", None, "team-a-ckpt"),  # tenant via gid
    ("x/checkpoints/step1", 1, 1, "write", None, "ckpt"),
    ("x/checkpoints/step1", 1, 1, "read", None, "default"),  # ckpt is write/meta only
    ("model.pt", 1, 1, "meta", None, "ckpt"),
    ("shared/a", 1, 1, "read", None, "shared"),
    ("shared/a", 1000, 1, "read", None, "default"),  # team-a is the first matching tenant
    ("data/a", 7, 150, "read", None, "alice-data"),
    ("data/a", 7, 1, "read", None, "data"),  # uids AND gids
    ("data/a", 8, 150, "read", None, "data"),
    ("data", 1, 1, "read", None, "data"),
    ("", 1, 1, "meta", None, "default"),
    ("data/a", 1, 1, "read", JobInfo(_slurm("5512"), None), "slurm-hot"),
    ("data/a", 1, 1, "read", JobInfo(_slurm("77"), None), "data"),
    ("data/a", 1, 1, "write", JobInfo(_slurm("77"), None), "any-job"),
    ("data/a", 1, 1, "write", JobInfo((), "/batch.slice/x"), "batch"),
    ("data/a", 1, 1, "write", JobInfo((), "/user.slice/x"), "data"),
    ("other", 1, 1, "read", JobInfo((), None), "default"),
])
def test_classify(classifier: Classifier, path: str, uid: int, gid: int, op: str,
                  job: JobInfo | None, expected: str) -> None:
    assert classifier.classify(path, uid, gid, op, job).name == expected
    assert classifier.classify(path, uid, gid, op, job).name == expected  # cached


def test_tenant_of(classifier: Classifier) -> None:
    assert classifier.tenant_of(1500, 1, "x").name == "team-a"  # type: ignore[union-attr]
    assert classifier.tenant_of(1, 500, "x").name == "team-a"  # type: ignore[union-attr]
    assert classifier.tenant_of(1, 1, "shared/x").name == "shared"  # type: ignore[union-attr]
    assert classifier.tenant_of(1, 1, "x") is None
    p = parse_policy('[tenants.t]\nuids = [5]\npaths = ["p/**"]\n')
    c = Classifier(p)
    assert c.tenant_of(5, 5, "p/x") is p.tenants[0]
    assert c.tenant_of(5, 5, "q/x") is None and c.tenant_of(6, 5, "p/x") is None


def test_default_policy_classes() -> None:
    c = Classifier(default_policy())
    assert c.classify("runs/r1/checkpoints/step_100/rank0.distcp", 1, 1, "write").name == (
        "checkpoints")
    assert c.classify("model.safetensors", 1, 1, "write").name == "checkpoints"
    # Reading a checkpoint back is not the checkpoint class's business: a .pt shard under
    # data/ is a dataset (it was charged to checkpoints and lost the dataset priority).
    assert c.classify("data/shards/x.pt", 1, 1, "read").name == "datasets"
    assert c.classify("model.safetensors", 1, 1, "read").name == "default"
    assert c.classify("data/imagenet/train/0001.jpg", 1, 1, "read").name == "datasets"
    assert c.classify("x/shard-0001.tar", 1, 1, "read").name == "datasets"
    assert c.classify("home/u/notes.txt", 1, 1, "write").name == "default"
    assert "checkpoints" in repr(c)


@pytest.mark.parametrize("path", [
    "data/train/shard-0.parquet", "x/train.h5", "x/features.npy", "x/shard-0001.tar",
])
def test_the_default_dataset_class_takes_reads_and_metadata_not_writes(path: str) -> None:
    """A write in a dataset's format (np.save of an optimizer state, a Keras .weights.h5)
    was charged to the protected class, at its priority and never capped."""
    c = Classifier(default_policy())
    assert c.classify(path, 1, 1, "read").name == "datasets"
    assert c.classify(path, 1, 1, "meta").name == "datasets"  # under a meta_iops cap
    assert c.classify(path, 1, 1, "write").name == "default"  # streams still move on


def test_classify_cache_is_bounded() -> None:
    c = Classifier(default_policy(), cache_size=16)
    for i in range(100):
        c.classify(f"f{i}", 1, 1, "read")
    assert c._classify.cache_info().currsize == 16


def _fake_proc(root: Path, pid: int, environ: bytes | None, cgroup: str | None) -> None:
    d = root / str(pid)
    d.mkdir()
    if environ is not None:
        (d / "environ").write_bytes(environ)
    if cgroup is not None:
        (d / "cgroup").write_text(cgroup)


def test_read_job_info(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 10, b"HOME=/root\0SLURM_JOB_ID=5512\0X=1\0", "0::/slurm/job_5512\n")
    _fake_proc(tmp_path, 11, b"SLURM_JOB_ID=\0", "12:cpu:/legacy\n0::/\n")
    _fake_proc(tmp_path, 12, None, None)
    proc = str(tmp_path)
    slurm = ("SLURM_JOB_ID",)
    assert read_job_info(10, slurm, proc_root=proc) == JobInfo(_slurm("5512"), "/slurm/job_5512")
    assert read_job_info(10, (), proc_root=proc) == JobInfo((), "/slurm/job_5512")
    assert read_job_info(10, ("SLURM_JOB",), proc_root=proc) == JobInfo((), "/slurm/job_5512")
    both = read_job_info(10, ("X", "SLURM_JOB_ID", "NONE"), proc_root=proc)
    assert both.env == (("X", "1"), ("SLURM_JOB_ID", "5512")) and both.value("X") == "1"
    assert both.value("NONE") is None
    assert read_job_info(11, slurm, proc_root=proc) == JobInfo((), "/", ("/legacy",))
    assert read_job_info(12, slurm, proc_root=proc) == JobInfo((), None)
    assert read_job_info(99, slurm, proc_root=proc) == JobInfo((), None)
    assert read_job_info(0, slurm) == JobInfo((), None)


def test_read_job_info_real_process() -> None:
    info = read_job_info(os.getpid(), ("PATH",))  # environ is the exec-time environment
    path = info.value("PATH")
    assert path is None or ":" in path or "/" in path
    assert info.cgroup is None or info.cgroup.startswith("/")


def test_job_cache_ttl_and_lru() -> None:
    now = [0.0]
    calls: list[int] = []

    def reader(pid: int, env_vars: tuple[str, ...]) -> JobInfo:
        calls.append(pid)
        return JobInfo((("J", f"job{pid}-{len(calls)}"),), None)

    cache = JobCache(maxsize=2, ttl=5.0, clock=lambda: now[0], reader=reader)
    assert cache.get(1, ("J",)).value("J") == "job1-1"
    assert cache.get(1, ("J",)).value("J") == "job1-1" and calls == [1]
    now[0] = 5.0  # expired: the pid may belong to another process now
    assert cache.get(1, ("J",)).value("J") == "job1-2"
    cache.get(2, ("J",))
    cache.get(1, ("J",))  # refresh 1's recency
    cache.get(3, ("J",))  # evicts 2, the least recently used
    assert len(cache) == 2 and calls == [1, 1, 2, 3]
    cache.get(1, ("J",))
    assert calls == [1, 1, 2, 3]
    cache.get(2, ("J",))
    assert calls == [1, 1, 2, 3, 2]
    cache.clear()
    assert len(cache) == 0 and "maxsize=2" in repr(cache)


def test_glob_errors_stay_on_one_line() -> None:
    with pytest.raises(GlobError, match=r'^invalid glob "/a\\nb": must be relative'):
        compile_glob("/a\nb")


@pytest.mark.parametrize("path", [
    "run1/model.pt.tmp",                        # torch.save, then rename
    "run1/model.pt.tmp8812",
    "run1/checkpoint-500/pytorch_model.bin",    # Hugging Face save_pretrained
    "run1/checkpoint-500/optimizer.pt",
    "run1/dcp/.metadata.tmp",                   # torch.distributed.checkpoint ...
    "run1/checkpoints/step100.pt",
    "ckpt_100.orbax-checkpoint-tmp-1234/state/d/0a1b2c3d",  # Orbax-like, renamed at the end
    # Checkpoint directories, whatever the format (np.save, h5py, ...)
    "run1/ckpt/opt_state.npy", "run1/ckpts/step_7/model.h5", "out/checkpoint/last.bin",
    "lightning_logs/version_0/checkpoints/epoch=3-step=100.ckpt",
    # TensorFlow: CheckpointManager's shards, index and state file, each through its
    # temporary name; Estimator; SavedModel; Keras 3
    "tf_ckpts/ckpt-7_temp/part-00000-of-00001.data-00000-of-00001.tempstate4417",
    "tf_ckpts/ckpt-7_temp/part-00000-of-00001.index.tempstate99",
    "tf_ckpts/ckpt-7.data-00000-of-00001", "tf_ckpts/ckpt-7.index",
    "tf_ckpts/checkpoint", "tf_ckpts/checkpoint.tmp5b1e0c3f9a2d4e6f8a1b2c3d4e5f6a7b",
    "est/model.ckpt-100.meta", "est/model.ckpt-100.index",
    "export/1/variables/variables.index", "export/1/variables/variables.data-00000-of-00002",
    "run1/model.keras", "run1/model.weights.h5", "run1/model_00001.weights.h5",
    # NeMo
    "run1/model.nemo", "nemo_experiments/gpt/2024-01-01/checkpoints/gpt--step=100-last.ckpt",
    # JAX: Flax's msgpack checkpoint (through "checkpoint_tmp"), Orbax written in place
    "flax/checkpoint_tmp", "flax/checkpoint_100",
    "run1/100/_CHECKPOINT_METADATA", "run1/100/state/_METADATA", "run1/100/state/_sharding",
    "run1/100/state/manifest.ocdbt", "run1/100/state/ocdbt.process_0/manifest.ocdbt",
    "run1/100/state/ocdbt.process_0/d/09e6fcdbd40758209378753db224b54d",
    "run1/100/state/d/b7799a97e94343d6b39680ff354fbe60", "run1/100/state/checkpoint",
])
def test_default_policy_catches_real_checkpoint_writers_by_name(path: str) -> None:
    c = Classifier(default_policy())
    assert c.classify(path, 1000, 1000, "write").name == "checkpoints", path


@pytest.mark.parametrize("path", [
    "data/train/shard-00000-of-00010.parquet",  # Hugging Face Hub shards
    "cache/hf/train/data-00000-of-00003.arrow",  # datasets.save_to_disk
    "tfds/mnist/3.0.1/mnist-train.tfrecord-00000-of-00001",
    "wds/shard-000001.tar", "x/train.h5", "x/features.npy",
    "lake/table/_metadata", "lake/table/_common_metadata",  # Parquet summaries
    "index/wiki.index", "x/d/readme.txt", "x/variables/temperature.nc",
])
def test_default_checkpoint_names_leave_dataset_files_alone(path: str) -> None:
    """Writing a dataset (preparing one, say) is not a checkpoint by name."""
    assert Classifier(default_policy()).classify(path, 1, 1, "write").name == "default"


def test_a_temporary_name_takes_the_class_of_the_name_it_will_get() -> None:
    assert final_name("a/model.pt.tmp") == "a/model.pt"
    assert final_name("a/.metadata.tmp") == "a/.metadata"
    # TensorFlow's BundleWriter: "<prefix>.data-00000-of-00001.tempstate<random>".
    assert final_name("t/ckpt-1.data-00000-of-00001.tempstate8812") == (
        "t/ckpt-1.data-00000-of-00001")
    assert final_name("t/ckpt-1.index.tempstate17") == "t/ckpt-1.index"
    assert final_name("ckpt_1.orbax-checkpoint-tmp-12/x") == "ckpt_1/x"
    assert final_name("run-tmp-3/x") == "run/x"
    assert final_name("a/.tmpab12cd") is None  # safetensors: no final name to read
    assert final_name("a/notes.txt") is None
    c = Classifier(parse_policy('[classes.weights]\npaths = ["**/*.bin"]\n'))
    assert c.classify("x/model.bin.tmp", 1, 1, "write").name == "weights"
    assert c.classify("x/other.tmp", 1, 1, "write").name == "default"


def test_cgroup_v1_and_hybrid_paths_match_too(tmp_path: Path) -> None:
    """A process in a Slurm v1 (or hybrid) cgroup used never to match: only "0::" was read."""
    _fake_proc(tmp_path, 20, None, "12:memory:/slurm/uid_1000/job_77/step_0\n"
               "11:cpuset:/slurm/uid_1000/job_77/step_0\n1:name=systemd:/system.slice/x\n")
    _fake_proc(tmp_path, 21, None, "0::/system.slice/slurmstepd.scope/job_78/step_0/user\n")
    v1 = read_job_info(20, (), proc_root=str(tmp_path))
    assert v1 == JobInfo((), None, ("/slurm/uid_1000/job_77/step_0", "/system.slice/x"))
    v2 = read_job_info(21, (), proc_root=str(tmp_path))
    c = Classifier(parse_policy('[classes.slurm]\ncgroups = ["/slurm/uid_*/job_7*/**", '
                                '"/system.slice/slurmstepd.scope/job_7*/**"]\n'))
    assert c.classify("f", 1, 1, "write", v1).name == "slurm"
    assert c.classify("f", 1, 1, "write", v2).name == "slurm"
    assert c.classify("f", 1, 1, "write", JobInfo((), "/", ("/user.slice/u",))).name == (
        "default")


def test_tenants_match_environment_values_and_classes_their_own_variable() -> None:
    """A namespace in the pod's environment makes a tenant; a class can match a job id
    from another variable in the same policy (one variable per policy was the old rule)."""
    policy = parse_policy('[tenants.team-a]\njob_env = "POD_NAMESPACE"\njobs = ["team-a*"]\n'
                          '[tenants.anyone-in-k8s]\njob_env = "POD_NAMESPACE"\n'
                          '[classes.a-hot]\ntenants = ["team-a"]\njob_env = "JOB"\n'
                          'jobs = ["7*"]\n')
    assert policy.job_envs == ("POD_NAMESPACE", "JOB")
    c = Classifier(policy)
    a_job = JobInfo((("POD_NAMESPACE", "team-a-prod"), ("JOB", "77")))
    assert c.tenant_of(1, 1, "x", a_job).name == "team-a"  # type: ignore[union-attr]
    assert c.classify("x", 1, 1, "write", a_job).name == "a-hot"
    b_job = JobInfo((("POD_NAMESPACE", "team-b"), ("JOB", "77")))
    assert c.tenant_of(1, 1, "x", b_job).name == "anyone-in-k8s"  # type: ignore[union-attr]
    assert c.classify("x", 1, 1, "write", b_job).name == "default"
    assert c.tenant_of(1, 1, "x", JobInfo()) is None and c.tenant_of(1, 1, "x") is None
    notes = policy_notes(policy)
    assert any("tenants.team-a matches by the environment variable POD_NAMESPACE" in n
               for n in notes)
