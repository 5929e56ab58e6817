"""The Sluice worker, one module per stage of the data flow (see ``app.py`` for the roles).

control.py   stage 1 of the control path: raw events → validated → per-pool partials
pictures.py  stage 2: partials → ControlLoop → pictures (sluice.load.v1), signals (sluice.admission.v1)
landing.py   the landing path: raw events and signals → ClickHouse, exactly once
consumer.py  what both paths' batch consumers share
http.py      /healthz, /metrics, /pools, /query
app.py       the Faust app, wired by role
"""
