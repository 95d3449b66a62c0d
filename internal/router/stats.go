package router

import "sync/atomic"

// Stats are a Router's counters since New. They count recorded attempts
// only: an attempt whose record failed is in none of them.
type Stats struct {
	// Delivered is the number of events delivered (2xx answers).
	Delivered int64
	// Failed is the number of failed delivery attempts, including those
	// that made their event DEAD.
	Failed int64
	// Dead is the number of events that became DEAD (Gone included).
	Dead int64
	// Gone is the number of events that became DEAD because their webhook
	// answered 410 Gone (which also disables the consumer).
	Gone int64
	// Conflicts is the number of attempts whose record lost the claim
	// (another router took the event after the claim expired).
	Conflicts int64
}

// counters is the concurrency-safe form of Stats.
type counters struct {
	delivered, failed, dead, gone, conflicts atomic.Int64
}

func (c *counters) snapshot() Stats {
	return Stats{
		Delivered: c.delivered.Load(),
		Failed:    c.failed.Load(),
		Dead:      c.dead.Load(),
		Gone:      c.gone.Load(),
		Conflicts: c.conflicts.Load(),
	}
}
