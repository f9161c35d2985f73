"""Alembic migrations of the control-plane database, run by :mod:`controlplane.db.migrate`.

This directory is Alembic's ``script_location``; it ships inside the wheel as a package so
``upgrade head`` works from an installed copy without an ``alembic.ini``.
"""
