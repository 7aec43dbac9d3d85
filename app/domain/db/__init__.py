"""The farm's database: ORM models, engine/session factories, migrations entry points."""
