"""Code both sides of MCP Edge import: protocol, bundle format, signing, versions.

Nothing in this package does network I/O or imports an I/O framework (asyncio, paho,
aiohttp, SQLAlchemy); ``tests/unit/test_shared_purity.py`` holds it to that.
"""

__version__ = "0.1.0"
