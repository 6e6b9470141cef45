// The dashboard (placeholder until the page lands).
