"""The create path: one transaction for the task, the receipt and the outbox rows; the idempotency contract; approvals that release held effects; retention of receipts."""
