"""`kvforge plan`: capacity planning on top of `kvforge.ledger` (pure Python; matplotlib only for --plot)."""
