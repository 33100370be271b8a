"""Bytes on the wire, counted by the OS, beside cloudburst's own counters (issue 18 item 4).

Each strategy's job runs alone in a fresh network namespace (``unshare -rn``, no privileges; only
its loopback device), so every socket there is the job's. Two OS counts:

- **per process**: ``ss -tinpH`` every ``SAMPLE_S``: each TCP socket's ``bytes_sent`` and
  ``bytes_received`` (payload), process and ports, its last sample its count. Sockets to or
  from a port the launcher listens on or a rank's ``MASTER_PORT`` are the store's; the rest
  are the data connections between ranks (gloo's pairs);
- **the namespace's total**: the loopback device's bytes and packets (``/proc/net/dev``) after
  the job; less ``HEADER_BYTES`` per packet and the store's bytes, it is the data the ranks
  sent each other, which the claim compares with the sum of their ``sent_bytes`` counters.

Sampled bytes are a lower bound (a socket's traffic after its last sample is lost when it
closes). Wire and counters differ by gloo's framing, by what the counters leave out by design
(start-up broadcasts, end-of-run measurement collectives) and, per rank, by sampling.

    .venv/bin/python benchmarks/wire.py [--quick] [--force]
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from cloudburst.models import build_model  # noqa: E402

#: Every strategy at W = 2 (asgd with one server shard, DASO on two emulated nodes: ``EXTRA``),
#: the MNIST-1D MLP; ``--steps`` per worker.
STRATEGIES = ("sync", "local_sgd", "diloco", "daso", "asgd")
EXTRA = {"daso": ["--nodes", "2"], "asgd": ["--servers", "1"]}
COMMON = ["--workers", "2", "--model", "mlp", "--eval-every-s", "1000", "--checkpoint-every", "0"]

#: Bytes a loopback packet carries besides its payload: Ethernet 14 + IPv4 20 + TCP with the
#: timestamp option 32 (Linux's default; the handshake's few packets carry 8 more).
HEADER_BYTES = 14 + 20 + 32
SAMPLE_S = 0.05  # ss's sampling period

_SOCKET = re.compile(r"^\S+\s+\d+\s+\d+\s+(?P<local>\S+)\s+(?P<peer>\S+)\s*(?P<rest>.*)$")
_PID = re.compile(r"pid=(\d+)")
_BYTES = re.compile(r"\b(bytes_sent|bytes_received):(\d+)")


def parse_ss(text: str) -> list[dict]:
    """``ss -tinpH`` output as one dict per socket: local, peer, pid, bytes_sent,
    bytes_received (a socket's line, then its tab-indented TCP_INFO line)."""
    sockets: list[dict] = []
    for line in filter(str.strip, text.splitlines()):
        if m := (_SOCKET.match(line) if not line[0].isspace() else None):
            pid = _PID.search(m["rest"])
            sockets.append({"local": m["local"], "peer": m["peer"], "pid": pid and int(pid[1]),
                            "bytes_sent": 0, "bytes_received": 0})  # fmt: skip
        elif sockets:
            sockets[-1].update((key, int(value)) for key, value in _BYTES.findall(line))
    return sockets


def ss(flags: str) -> list[dict]:
    return parse_ss(subprocess.run(["ss", flags], capture_output=True, text=True).stdout)


def port(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def lo_counters() -> dict[str, int]:
    """The loopback device's received and transmitted bytes and packets (/proc/net/dev)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            f = [int(x) for x in fields.split()]
            return {"rx_bytes": f[0], "rx_packets": f[1], "tx_bytes": f[8], "tx_packets": f[9]}
    raise RuntimeError("no loopback device in /proc/net/dev")


def probe(out: Path, argv: list[str]) -> int:
    """Inside the namespace: bring lo up, run the job, sample its sockets until it exits."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    job = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    last: dict[tuple, dict] = {}  # (local, peer, generation) -> the connection's latest sample
    listeners: dict[int, int | None] = {}  # listening port -> pid
    master_ports: set[int] = set()
    samples = 0
    while job.poll() is None:
        merge(last, ss("-tinpH"))
        for s in ss("-tlnpH"):
            listeners.setdefault(port(s["local"]), s["pid"])
        for s in last.values():
            master_ports |= _master_port(s["pid"])
        samples += 1
        time.sleep(SAMPLE_S)
    stderr = job.stderr.read() if job.stderr else ""
    result = {"returncode": job.returncode, "stderr_tail": stderr.strip().splitlines()[-3:],
              "samples": samples, "sockets": list(last.values()),
              "listeners": {str(k): v for k, v in listeners.items()},
              "master_ports": sorted(master_ports), "lo": lo_counters()}  # fmt: skip
    out.write_text(json.dumps(result))
    return job.returncode


def merge(last: dict[tuple, dict], sockets: list[dict]) -> None:
    """Each connection's latest sample, once. A connection is its (local, peer) pair: a sample
    without a pid (the process exiting) keeps the pid seen before, so its bytes are not counted
    again as the launcher's; counters that went down mean the pair was reused by a new
    connection, kept beside the old one."""
    for s in sockets:
        gen = 0
        while (prev := last.get((s["local"], s["peer"], gen))) is not None and (
            s["bytes_sent"] < prev["bytes_sent"] or s["bytes_received"] < prev["bytes_received"]
        ):
            gen += 1
        if prev is not None and s["pid"] is None:
            s = {**s, "pid": prev["pid"]}
        last[(s["local"], s["peer"], gen)] = s


_ENV_CACHE: dict[int, set[int]] = {}


def _master_port(pid: int | None) -> set[int]:
    if pid is not None and pid not in _ENV_CACHE:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return set()
        _ENV_CACHE[pid] = {int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"MASTER_PORT=")}
    return _ENV_CACHE.get(pid, set())


def rank_records(out_dir: Path) -> dict[int, dict]:
    """Per rank: its pid (the ``start`` record) and its counters (the ``final`` record)."""
    ranks: dict[int, dict] = {}
    for _, r in harness.records(out_dir):
        rank = ranks.setdefault(int(r["rank"]), {"role": r.get("role")})
        if r.get("event") == "start":
            rank["pid"] = r["pid"]
        elif r.get("event") == "final":
            rank.update(sent_bytes=r.get("sent_bytes"), received_bytes=r.get("received_bytes"))
    return ranks


def account(result: dict, ranks: dict[int, dict]) -> dict:
    """Split the sampled sockets into store and data bytes per rank; beside the counters."""
    pid_rank = {r["pid"]: rank for rank, r in ranks.items() if "pid" in r}
    store_ports = set(result["master_ports"]) | {
        int(p) for p, pid in result["listeners"].items() if pid not in pid_rank
    }
    keys = ("data_sent", "data_received", "store_sent", "store_received")
    per_rank = {rank: dict.fromkeys(keys, 0) for rank in ranks}
    other = {"sent": 0, "received": 0}  # the launcher's side of the store connections
    for s in result["sockets"]:
        rank = pid_rank.get(s["pid"])
        if rank is None:
            into, kind = other, ""
        else:
            ports = {port(s["local"]), port(s["peer"])}
            into, kind = per_rank[rank], "store_" if ports & store_ports else "data_"
        into[f"{kind}sent"] += s["bytes_sent"]
        into[f"{kind}received"] += s["bytes_received"]
    rows = [{"rank": rank, "role": r.get("role"), "counted_sent": r.get("sent_bytes"),
             "counted_received": r.get("received_bytes"), **per_rank[rank]}
            for rank, r in sorted(ranks.items())]  # fmt: skip
    lo = result["lo"]
    store = sum(r["store_sent"] for r in per_rank.values()) + other["sent"]
    lo_payload = lo["tx_bytes"] - lo["tx_packets"] * HEADER_BYTES
    return {"ranks": rows, "other": other,
            "socket_payload_sent": sum(s["bytes_sent"] for s in result["sockets"]),
            "store_sent": store, "lo": lo, "lo_payload": lo_payload,
            "lo_data": lo_payload - store,  # every rank's data connections, nothing missed
            "counted_sent": sum(r.get("sent_bytes") or 0 for r in ranks.values()),
            "samples": result["samples"]}  # fmt: skip


def run_wire(arm: harness.Arm, seed: int, out_dir: Path) -> harness.Run:
    """The job alone in a new network namespace, its sockets sampled (:func:`probe`)."""
    probe_json = out_dir.parent / f"seed{seed}.probe.json"
    probe_json.unlink(missing_ok=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    wrap = ["unshare", "-rn", sys.executable, __file__, "--probe", str(probe_json), "--"]
    wrap += [*harness.CLI, "train"]
    r = harness.run_train(arm, seed, out_dir, command=wrap)
    if not r.failed and not probe_json.is_file():
        r.failed = "no probe output"
    elif not r.failed:
        r.values = account(json.loads(probe_json.read_text()), rank_records(out_dir))
    return r


def ratio(a: int | None, b: int | None) -> float | None:
    return None if not a or not b else a / b


def main() -> None:
    if "--probe" in sys.argv:  # the part that runs inside the namespace
        argv = sys.argv
        sys.exit(probe(Path(argv[argv.index("--probe") + 1]), argv[argv.index("--") + 1 :]))

    args, prov = harness.start(__doc__)
    model = build_model("mlp", (40,), 10, 0)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    steps = 40 if args.quick else 200  # per worker
    flags = [*COMMON, "--steps", str(steps)]
    arms = [harness.Arm(n, ["--strategy", n, *EXTRA.get(n, []), *flags]) for n in STRATEGIES]
    root = prov.runs_dir("wire")
    runs = harness.interleave(
        arms,
        [0],
        prov=prov,
        run=lambda arm, seed: run_wire(arm, seed, root / arm.name / f"seed{seed}"),
    )
    report = harness.Report("wire", "Bytes on the wire (OS) beside cloudburst's counters", prov)
    report.settings(
        f"W = 2, MNIST-1D MLP, {steps} steps per worker, seed 0; `ss -tinpH` every "
        f"{SAMPLE_S:g} s.\n\n{harness.about(__doc__)}"
    )
    rows, jobs = [], []
    for r in runs:
        if r.failed:
            jobs.append([r.arm, "FAILED", r.failed, "", "", "", ""])
            continue
        v = report.data[r.arm] = r.values
        wire = ratio(v["lo_data"], v["counted_sent"])
        jobs.append([r.arm, v["counted_sent"], v["lo_data"], harness.fmt(wire, 4),
                     v["store_sent"], v["lo"]["tx_packets"], v["samples"]])  # fmt: skip
        ok = None if wire is None else abs(wire - 1) <= 0.05
        report.claim(f"wire ÷ counted bytes, {r.arm}", wire, "1 ± 0.05", ok, seeds=1)
        for x in v["ranks"]:
            pairs = [(x[f"counted_{w}"], x[f"data_{w}"]) for w in ("sent", "received")]
            cells = (y for c, d in pairs for y in (c, d, harness.fmt(ratio(d, c), 4)))
            rows.append([r.arm, x["rank"], x["role"], *cells])
    report.section("Job totals: loopback payload less the store's vs the counters")
    report.table("strategy | counted sent | wire data (lo) | wire ÷ counted | store bytes | "
                 "lo packets | ss samples", jobs)  # fmt: skip
    report.section("Per rank: sampled sockets (payload) vs the counters")
    report.text(
        f"The model's parameters are {model_bytes} bytes: a start-up broadcast of them "
        "(DDP, the strategies' initial sync) is on the wire and not in the counters. A "
        "socket's traffic after its last sample is missing here (not in the lo totals)."
    )
    report.table("strategy | rank | role | counted sent | wire sent | ÷ | counted received | "
                 "wire received | ÷", rows)  # fmt: skip
    report.write(runs)


if __name__ == "__main__":
    main()
