"""Storage: the database is the source of truth (SQLAlchemy 2 async Core; SQLite or PostgreSQL)."""
