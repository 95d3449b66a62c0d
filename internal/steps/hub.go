package steps

import (
	"sync"

	"github.com/google/uuid"
)

// Hub fans the item notifications of one process out to the live sessions
// waiting on their units. It is safe for concurrent use.
type Hub struct {
	mu   sync.Mutex
	subs map[uuid.UUID]map[chan struct{}]struct{}
}

// NewHub returns an empty hub.
func NewHub() *Hub { return &Hub{subs: map[uuid.UUID]map[chan struct{}]struct{}{}} }

// Subscribe returns a channel that receives (coalesced) wake-ups for unit,
// and the function that ends the subscription.
func (h *Hub) Subscribe(unit uuid.UUID) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	h.mu.Lock()
	if h.subs[unit] == nil {
		h.subs[unit] = map[chan struct{}]struct{}{}
	}
	h.subs[unit][ch] = struct{}{}
	h.mu.Unlock()
	return ch, func() {
		h.mu.Lock()
		delete(h.subs[unit], ch)
		if len(h.subs[unit]) == 0 {
			delete(h.subs, unit)
		}
		h.mu.Unlock()
	}
}

// Notify wakes the sessions of unit; uuid.Nil wakes every session (the
// listener reconnected and may have missed notifications). It never blocks.
func (h *Hub) Notify(unit uuid.UUID) {
	h.mu.Lock()
	defer h.mu.Unlock()
	wake := func(subs map[chan struct{}]struct{}) {
		for ch := range subs {
			select {
			case ch <- struct{}{}:
			default:
			}
		}
	}
	if unit == uuid.Nil {
		for _, subs := range h.subs {
			wake(subs)
		}
		return
	}
	wake(h.subs[unit])
}
