"""What a run reports: the typed record (report.json) and the page that shows it."""

# The shape of every JSON object pretuner prints or writes; raised when a key changes meaning or
# goes away (a new key does not raise it). A report.json without it predates it: version 1.
# 2: one record for both methods, the method's own figures under `derivation`.
SCHEMA_VERSION = 2
