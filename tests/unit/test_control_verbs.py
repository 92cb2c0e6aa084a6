"""The verb table: one row per protocol verb, and every face of a fence serves every row."""

from __future__ import annotations

from pathlib import Path

from rollpoint.http.app import create_app
from rollpoint.participant import Fence, mount_participant
from rollpoint.participant.control_settings import ControlSettings
from rollpoint.participant.fence_verbs import fence_handlers
from rollpoint.protocol.control import CONTROL_PREFIX, Verb
from rollpoint.protocol.control_verbs import VERBS
from tests.unit.participant.fake_participant import FakeParticipant


def test_every_verb_has_one_row_in_protocol_order() -> None:
    assert list(VERBS) == list(Verb)
    for verb, row in VERBS.items():
        assert row.verb is verb
        assert row.path == f"{CONTROL_PREFIX}/{verb}"
    # Only status is read without a body, and only it is a GET.
    assert [v for v, row in VERBS.items() if row.request is None] == [Verb.STATUS]
    assert [v for v, row in VERBS.items() if row.method == "GET"] == [Verb.STATUS]


def test_the_routes_and_the_handlers_cover_the_table(tmp_path: Path) -> None:
    app = create_app("verbs")
    mount_participant(app, FakeParticipant(), token="t", snapshot_root=str(tmp_path))
    routes = {
        (route.path, method)
        for route in app.routes
        for method in getattr(route, "methods", ())
        if route.path.startswith(CONTROL_PREFIX)
    }
    assert routes == {(row.path, row.method) for row in VERBS.values()}
    fence = Fence(FakeParticipant(), ControlSettings(token="t", snapshot_root=str(tmp_path)))
    assert list(fence_handlers(fence)) == list(VERBS)
