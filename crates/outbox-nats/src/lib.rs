//! # outbox-nats
//!
//! NATS JetStream delivery for the outbox: **not built yet**. This crate holds its place in the
//! workspace; it exports nothing. Until it lands, deliver through any [`outbox_core::Handler`].
