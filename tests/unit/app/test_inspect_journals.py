"""``rollpoint inspect`` shows each participant's journal: records, bytes, segments, the last
durable record, and damage, without changing a file."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from rollpoint.app.snapshot_report import build_report, render_report
from rollpoint.store.journal import Journal


async def test_inspect_lists_each_journal_with_its_last_durable_record(tmp_path: Path) -> None:
    root = tmp_path / "store"
    model = Journal.open(str(root / "journal" / "model" / "model-replica-0"))
    await model.append_json("model|r1|a0|t0|c0", "policy_call", {"n": 1})
    end = await model.append_json("model|r1|a0|t1|c0", "policy_call", {"n": 2})
    await model.close()
    agent = Journal.open(str(root / "journal" / "agent" / "agent-replica-0"))
    await agent.close()  # no record yet
    # A torn tail: a record cut short by a kill.
    tool = Journal.open(str(root / "journal" / "resources" / "resources-replica-0"))
    await tool.append_json("tool|r1|a0|t0|c0", "tool_call", {"ok": True})
    await tool.close()
    segment = next((root / "journal" / "resources" / "resources-replica-0").glob("*.rpj"))
    segment.write_bytes(segment.read_bytes() + b"\x40\x00\x00\x00torn")
    before = sorted((p, p.stat().st_size) for p in root.rglob("*") if p.is_file())

    report = build_report(str(root))

    shown = {(j["kind"], j["instance"]): j for j in report["journals"]}
    assert set(shown) == {
        ("agent", "agent-replica-0"),
        ("model", "model-replica-0"),
        ("resources", "resources-replica-0"),
    }
    model_row = shown[("model", "model-replica-0")]
    assert (model_row["records"], model_row["segments"]) == (2, 1)
    assert (model_row["last_key"], model_row["last_kind"]) == ("model|r1|a0|t1|c0", "policy_call")
    assert model_row["last_position"] == [end.segment, end.offset]
    assert model_row["bytes"] == end.offset - 28 and model_row["damage"] is None
    assert shown[("agent", "agent-replica-0")]["records"] == 0
    torn = shown[("resources", "resources-replica-0")]
    assert torn["records"] == 1 and "offset" in torn["damage"]
    # Read only: no file changed, none set aside.
    assert sorted((p, p.stat().st_size) for p in root.rglob("*") if p.is_file()) == before

    console = Console(width=240, record=True)
    render_report(report, console)
    text = console.export_text()
    assert "journals" in text and "model/model-replica-0" in text
    assert "policy_call model|r1|a0|t1|c0" in text and "damaged" in text
