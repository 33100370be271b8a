"""wire.py's socket bookkeeping on scripted ``ss`` samples: a connection counts once, also when
its last sample came after its process exited (no pid) and a reused address pair."""

from __future__ import annotations

import pytest

from benchmarks import wire

RANK_PID, LAUNCHER_PID = 101, 7


def sample(local: str, peer: str, pid: int | None, sent: int, received: int) -> dict:
    return {"local": local, "peer": peer, "pid": pid, "bytes_sent": sent,
            "bytes_received": received}  # fmt: skip


def test_parse_ss_reads_addresses_pid_and_counters():
    text = (
        'ESTAB 0 0 127.0.0.1:40000 127.0.0.1:29500 users:(("python",pid=101,fd=5))\n'
        "\t cubic bytes_sent:1200 bytes_acked:1201 bytes_received:300 segs_out:4\n"
        "ESTAB 0 0 127.0.0.1:40002 127.0.0.1:40004\n"
        "\t cubic bytes_received:55\n"
    )
    assert wire.parse_ss(text) == [
        sample("127.0.0.1:40000", "127.0.0.1:29500", 101, 1200, 300),
        sample("127.0.0.1:40002", "127.0.0.1:40004", None, 0, 55),
    ]


def test_merge_keeps_an_exited_sockets_pid_and_account_counts_it_once_as_data():
    last: dict = {}
    wire.merge(last, [sample("a:1", "a:2", RANK_PID, 100, 10)])
    wire.merge(last, [sample("a:1", "a:2", None, 400, 40)])  # the process has exited
    assert list(last.values()) == [sample("a:1", "a:2", RANK_PID, 400, 40)]
    result = {"sockets": list(last.values()), "listeners": {}, "master_ports": [],
              "lo": {"rx_bytes": 0, "rx_packets": 0, "tx_bytes": 400, "tx_packets": 0},
              "samples": 2}  # fmt: skip
    ranks = {0: {"role": "worker0", "pid": RANK_PID, "sent_bytes": 400, "received_bytes": 40}}
    got = wire.account(result, ranks)
    assert got["other"] == {"sent": 0, "received": 0}
    assert got["ranks"][0]["data_sent"] == 400
    assert got["socket_payload_sent"] == 400
    assert got["lo_data"] == 400  # lo's payload less the store's (none here)


@pytest.mark.parametrize("pid", [RANK_PID, None])
def test_merge_updates_one_connection_in_place_and_keeps_a_reused_pair_as_a_second(pid):
    last: dict = {}
    for sent in (100, 200, 500):
        wire.merge(last, [sample("a:1", "a:2", pid, sent, sent)])
    assert [s["bytes_sent"] for s in last.values()] == [500]
    wire.merge(last, [sample("a:1", "a:2", LAUNCHER_PID, 20, 5)])  # counters fell: a new one
    wire.merge(last, [sample("a:1", "a:2", LAUNCHER_PID, 30, 6)])
    assert sorted(s["bytes_sent"] for s in last.values()) == [30, 500]
