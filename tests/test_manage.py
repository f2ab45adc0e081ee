"""Flags for keys the settings module reads at import are honoured (manage.py hoists them)."""

import subprocess
import sys

from tests.conftest import ROOT


def test_data_dir_flag_moves_the_state_folder(tmp_path):
    target = tmp_path / "state"
    code = (
        "import sys, manage; manage.hoist_early_flags(sys.argv); import os;"
        "os.environ['DJANGO_SETTINGS_MODULE']='ignis_site.settings'; import django; django.setup();"
        "from django.conf import settings; print(settings.VAR_DIR, settings.IGNIS['server.log_level'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "--server-data-dir", str(target), "--server-log-level=warning"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == [str(target), "warning"]
    assert (target / "secret_key").exists()


def test_switch_interval_is_the_process_setting_in_microseconds():
    """server.switch_interval_us becomes the interpreter's switch interval; past its bounds the
    value is refused before anything starts."""
    import pytest

    from apps.models.management.commands._options import switch_interval
    from ignis_site import config

    before = sys.getswitchinterval()
    try:
        switch_interval(config.load({"server.switch_interval_us": "250"}))
        assert sys.getswitchinterval() == pytest.approx(250e-6)
        switch_interval(config.load())
        assert sys.getswitchinterval() == pytest.approx(5e-3)  # the default: Python's own
    finally:
        sys.setswitchinterval(before)
    with pytest.raises(ValueError):
        config.load({"server.switch_interval_us": "20"})
