"""Code both sides of actq import: settings, schemas, the job store, the model registry,
the capture-spec grammar and the artifact stores. Importing it never imports torch."""
