"""npu-smi parsing, table-driven."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from pretuner.devices.base import DeviceReadError, run_tool
from pretuner.devices.npu_smi import NpuCard, detect_card, free_mib, parse_npu_smi
from pretuner.errors import BadInputError

RULE = "+" + "-" * 27 + "+" + "-" * 15 + "+" + "-" * 52 + "+"
EQ = RULE.replace("-", "=")
HEADER_910B = f"""\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.6                   Version: 23.0.6                                               |
{RULE}
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
{EQ}
"""


def card_910b(npu: int, used: str, health: str = "OK") -> str:
    return (
        f"| {npu:<5} 910B3               | {health:<13} "
        "| 97.5        41                0    / 0             |\n"
        f"| 0                         | 0000:C{npu}:00.0  "
        f"| 0           0    / 0          {used:<21}|\n"
        f"{EQ}\n"
    )


PROCESS_TABLE = f"""\
{RULE}
| NPU   Chip                | Process id    | Process name             | Process memory(MB)      |
{EQ}
| 0     0                   | 412345        | python3                  | 38318                   |
{EQ}
| 1     0                   | 412346        | python3                  | 38318                   |
{EQ}
| No running processes found in NPU 2                                                            |
{EQ}
"""

USED = ["3379 / 65536", "41697/ 65536", "41697 /65536", "0 / 65536"] + ["3379 / 65536"] * 4
SMI_910B_8 = (
    HEADER_910B
    + "".join(card_910b(i, used, "Warning" if i == 5 else "OK") for i, used in enumerate(USED))
    + PROCESS_TABLE
)

SMI_A3 = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 24.1.0                   Version: 24.1.0                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU     Name              | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip    Phy-ID            | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0       Ascend910         | OK            | 180.2       40                0    / 0             |
| 0       0                 | 0000:9D:00.0  | 0           0    / 0          3100 / 65536         |
+---------------------------+---------------+----------------------------------------------------+
| 0       Ascend910         | OK            | -           41                0    / 0             |
| 1       1                 | 0000:9F:00.0  | 0           0    / 0          52000/ 65536         |
+===========================+===============+====================================================+
| 1       Ascend910         | OK            | 175.0       39                0    / 0             |
| 0       2                 | 0000:99:00.0  | 0           0    / 0          2900 / 65536         |
+---------------------------+---------------+----------------------------------------------------+
| 1       Ascend910         | OK            | -           40                0    / 0             |
| 1       3                 | 0000:9B:00.0  | 0           0    / 0          2901 / 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| 0       0                 | 1234          | python3                  | 49000                   |
+===========================+===============+====================================================+
"""


def test_910b_eight_cards_with_process_table() -> None:
    cards = parse_npu_smi(SMI_910B_8)
    assert [c.npu_id for c in cards] == list(range(8))
    assert all(c.chip == 0 and c.name == "910B3" for c in cards)
    assert cards[0] == NpuCard(0, 0, "910B3", "OK", 3379, 65536)
    assert (cards[1].hbm_used_mib, cards[1].hbm_total_mib) == (41697, 65536)  # touching slash
    assert (cards[2].hbm_used_mib, cards[2].hbm_total_mib) == (41697, 65536)
    assert cards[5].health == "Warning"
    assert [free_mib(c) for c in cards[:4]] == [62157, 23839, 23839, 65536]


def test_a3_two_chips_per_npu() -> None:
    cards = parse_npu_smi(SMI_A3)
    assert [(c.npu_id, c.chip) for c in cards] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(c.name == "Ascend910" for c in cards)
    assert cards[1].hbm_used_mib == 52000
    assert free_mib(cards[1]) == 13536


def test_crlf_output() -> None:
    assert parse_npu_smi(SMI_A3.replace("\n", "\r\n")) == parse_npu_smi(SMI_A3)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n\n",
        "dcmi model initialized failed, because the device is used. ret is -8020",
        "-bash: npu-smi: command not found",
        "| | | |\n|||\n+-+\n| 0 | x | 1/2 |",
        HEADER_910B,  # no cards
        HEADER_910B + "| 0     910B3  | OK  | 97.5 41 0 / 0 |\n",  # name row, chip row cut off
        # a chip row without a name row above
        "| 0               | 0000:C1:00.0  | 0           0    / 0          3379 / 65536 |",
        PROCESS_TABLE,
        "\x00\xff garbage | \u2603 | 12/",
    ],
)
def test_garbage_gives_no_cards(text: str) -> None:
    assert parse_npu_smi(text) == ()


def read_npu_smi(executable: str, timeout_s: float = 10) -> tuple[NpuCard, ...]:
    try:
        return parse_npu_smi(run_tool([executable, "info"], timeout_s))
    except DeviceReadError:
        return ()


def test_missing_executable_gives_no_cards(tmp_path: Path) -> None:
    assert read_npu_smi(str(tmp_path / "npu-smi")) == ()


def test_reads_a_real_executable(tmp_path: Path) -> None:
    fake = tmp_path / "npu-smi"
    table = tmp_path / "table.txt"
    table.write_text(SMI_A3)
    fake.write_text(f'#!/bin/sh\n[ "$1" = info ] && exec cat {table}\nexit 2\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    assert read_npu_smi(str(fake)) == parse_npu_smi(SMI_A3)


def test_failing_or_hanging_executable_gives_no_cards(tmp_path: Path) -> None:
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\necho 'dcmi init failed' >&2\nexit 3\n")
    hanging = tmp_path / "hanging"
    hanging.write_text("#!/bin/sh\nexec sleep 30\n")
    for path in (failing, hanging):
        path.chmod(stat.S_IRWXU)
    assert read_npu_smi(str(failing)) == ()
    assert read_npu_smi(str(hanging), timeout_s=0.5) == ()


@pytest.mark.parametrize(("script", "says"), [
    ("exec sleep 30", "timed out after 0.5 s"),
    ("echo 'dcmi init failed' >&2; exit 3", "exited with code 3"),
])  # fmt: skip
def test_a_hung_or_failing_npu_smi_is_named_as_such_not_as_missing(
    tmp_path: Path, script: str, says: str
) -> None:
    """Issue 28 #11: a hung npu-smi (a wedged driver) was reported as "not available"."""
    fake = tmp_path / "npu-smi"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(stat.S_IRWXU)
    with pytest.raises(BadInputError, match=f"no card size: .*{says}") as caught:
        detect_card([str(fake), "info"], "npu-smi", None, {}, timeout_s=0.5)
    assert "not available" not in str(caught.value)
    with pytest.raises(BadInputError, match="npu-smi is not available here"):
        detect_card([str(tmp_path / "absent" / "npu-smi"), "info"], "npu-smi", None, {})
