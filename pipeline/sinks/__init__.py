"""Where accepted events land: ClickHouse, embedded (chdb) or a server."""
