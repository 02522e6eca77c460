"""The distlocks demo site: ``make demo`` runs :mod:`demo_project.run`."""
