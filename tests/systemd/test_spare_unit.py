"""The hot spare's unit (docs/spare.md): `kimi-supervisor-spare@NAME` runs NAME.spare.toml, bound to the weight holder,
ordered after the engine, restarted by itself in seconds, and pulled in by every (re)start of the holder."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_supervisor.config.load import load_config
from kimi_supervisor.deployment.choose import for_config
from kimi_supervisor.deployment.spare import Spare
from kimi_supervisor.exitcodes import ConfigError, ExitCode
from kimi_supervisor.systemd import unit
from tests.config.test_spare_config import SPARE, engine_text


def test_the_spares_template_binds_it_to_the_holder_and_orders_it_after_the_engine() -> None:
    text = unit.render(["/opt/k/bin/kimi-supervisor"], Path("/etc/kimi-supervisor/x.toml"), spare=True, doc=None)
    assert "ExecStart=/opt/k/bin/kimi-supervisor --config /etc/kimi-supervisor/%i.spare.toml\n" in text
    assert "BindsTo=kimi-supervisor-weights@%i.service\n" in text
    assert "After=kimi-supervisor-weights@%i.service kimi-supervisor@%i.service\n" in text
    assert "BindsTo=kimi-supervisor@" not in text and "PartOf=" not in text  # the engine's restarts leave it be
    assert "Restart=on-failure\nRestartSec=2\n" in text
    assert "SyslogIdentifier=kimi-supervisor-spare@%i\n" in text
    assert "WantedBy=multi-user.target kimi-supervisor-weights@%i.service\n" in text
    # The engine's and the holder's templates are as they were.
    assert "SyslogIdentifier=kimi-supervisor@%i\n" in unit.render(template=True, doc=None)
    assert "SyslogIdentifier=kimi-supervisor-weights@%i\n" in unit.render(holder=True, doc=None)


def test_install_unit_with_the_spares_config_writes_its_template_and_drop_in(tmp_path: Path) -> None:
    (tmp_path / "kimi.toml").write_text(engine_text(tmp_path))
    config = tmp_path / "kimi.spare.toml"
    config.write_text(SPARE)
    role = for_config(load_config(config))
    assert isinstance(role, Spare)
    units = tmp_path / "units"
    written = role.install_own_unit(config, units, reload=False, instance=None)
    assert written == units / unit.SPARE_TEMPLATE_NAME and written.is_file()
    dropin = units / "kimi-supervisor-spare@kimi.service.d" / unit.DROPIN_NAME
    assert "TimeoutStopSec=" in dropin.read_text()
    other = tmp_path / "other.spare.toml"
    other.write_text(SPARE)
    with pytest.raises(ConfigError) as info:
        for_config(load_config(other)).install_own_unit(other, units, reload=False, instance=None)
    assert info.value.exit_code == ExitCode.CONFIG and "name the spare's config after its deployment" in str(info.value)


def test_the_shipped_spare_template_is_the_rendered_one() -> None:
    shipped = Path(__file__).resolve().parents[2] / "packaging" / "systemd" / unit.SPARE_TEMPLATE_NAME
    assert shipped.read_text() == unit.render(spare=True)
