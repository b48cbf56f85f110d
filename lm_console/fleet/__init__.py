"""The fleet: several servers (ours or vLLM) watched through their Prometheus /metrics.

config.py reads the fleet file (TOML) and the command line's URLs; metrics.py turns successive
/metrics readings into one row of figures; alerts.py holds the thresholds and the log of alerts
fired and cleared; monitor.py polls the servers. `lmc tui --url A --url B` (lm_console/tui/fleet_app.py)
and `lmc top` (lm_console/cli_top.py) are built on them. Imports no torch and no Textual.
"""
