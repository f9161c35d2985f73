"""Hardware profiles: one TOML file per device class, shipped inside the wheel.

Read them with :func:`shared.profiles.load_profiles`; this package only holds the data.
"""
