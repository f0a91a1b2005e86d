package main

// One "generation" of the library's inner workqueue: what one Start() of the library creates.
//
// The library builds its workqueue in Start() (queue.go:443-450) from the config it was given with
// WithWorkqueueConfigOption. Before every Start() the driver writes a fresh *gen into that config's
// DelayingQueue field, so the library's rateLimitingType wraps a gen instead of a delaying queue it
// would make itself. A gen is the same composition client-go makes by default
// (NewTypedDelayingQueueWithConfig over a Typed FIFO, wq/delaying_queue.go:101-119): a real client-go
// Typed queue (dedup, dirty/processing sets, shutdown, drain: all the original code) under a real
// client-go delaying queue (its waiting loop and heap on the real clock). Nothing is reimplemented;
// every call is passed on, and the driver only watches the calls go by:
//
//   - Add (Send in RUNNING, the flush in Start, RetryNow), the delaying loop's Add (a timer fired),
//     AddAfter (reschedule, RetryAfter), Get (dispatch), Done (end of an attempt), ShutDown*;
//   - under one driver mutex (mu), so the driver's mirror of the Typed queue's sets (queued, dirty,
//     processing) and of the delay heap is exact and every observation is made in the order the
//     library's calls happened.
//
// Get never blocks while holding mu: a worker waits on a condition variable (over mu) until the
// mirror has something queued or the Typed queue is shutting down; then the real Get returns at once.

import (
	"fmt"
	"sync/atomic"
	"time"

	req "github.com/simplegear/rate-envelope-queue"
	"k8s.io/client-go/util/workqueue"
)

// adds: a client-go metrics provider whose only purpose is the "adds" counter, which Typed.Add bumps
// exactly when it inserts the item into its dirty set (wq/queue.go:218-242). Its delta tells whether
// an Add was new work, a dedup, or ignored because the queue is shutting down.
type metric struct{ n atomic.Int64 }

func (c *metric) Inc()            { c.n.Add(1) }
func (c *metric) Dec()            { c.n.Add(-1) }
func (c *metric) Set(float64)     {}
func (c *metric) Observe(float64) {}

type provider struct{ adds *metric }

func (p provider) NewDepthMetric(string) workqueue.GaugeMetric            { return &metric{} }
func (p provider) NewAddsMetric(string) workqueue.CounterMetric           { return p.adds }
func (p provider) NewLatencyMetric(string) workqueue.HistogramMetric      { return &metric{} }
func (p provider) NewWorkDurationMetric(string) workqueue.HistogramMetric { return &metric{} }
func (p provider) NewUnfinishedWorkSecondsMetric(string) workqueue.SettableGaugeMetric {
	return &metric{}
}
func (p provider) NewLongestRunningProcessorSecondsMetric(string) workqueue.SettableGaugeMetric {
	return &metric{}
}
func (p provider) NewRetriesMetric(string) workqueue.CounterMetric { return &metric{} }

// member: where one envelope is inside one generation (the driver's mirror of client-go's sets).
type member struct {
	queued     bool // in the FIFO (dirty, not processing)
	dirty      bool // in the dirty set (queued, or re-added while processing: re-run after Done)
	processing bool
	delayed    bool // an entry in the delaying loop's heap
	readyAt    time.Time
}

type gen struct {
	s    *session
	n    int
	raw  *workqueue.Typed[*req.Envelope]
	real workqueue.TypedDelayingInterface[*req.Envelope] // client-go's delaying queue over fire{g}
	adds *metric
	mem  map[*req.Envelope]*member // the mirror, by envelope pointer
	qlen int                       // mirror: length of the FIFO
	shut bool                      // the Typed queue is shutting down (set under mu once it is)
}

// memberOf: the mirror entry of e in this generation (made on first use).
func (g *gen) memberOf(e *req.Envelope) *member {
	m := g.mem[e]
	if m == nil {
		m = &member{}
		g.mem[e] = m
		if rec := recs[e]; rec != nil {
			rec.gens = append(rec.gens, g)
		}
	}
	return m
}

// fire is the Typed interface the client-go delaying queue wraps: its Add is a timer of the heap
// firing; everything else goes straight to the Typed queue (no driver lock: the driver may hold mu
// when it calls the delaying queue's ShutDown).
type fire struct{ g *gen }

func (f fire) Add(e *req.Envelope)        { f.g.add(e, srcFire) }
func (f fire) Len() int                   { return f.g.raw.Len() }
func (f fire) Get() (*req.Envelope, bool) { return f.g.raw.Get() }
func (f fire) Done(e *req.Envelope)       { f.g.raw.Done(e) }
func (f fire) ShutDown()                  { f.g.raw.ShutDown() }
func (f fire) ShutDownWithDrain()         { f.g.raw.ShutDownWithDrain() }
func (f fire) ShuttingDown() bool         { return f.g.raw.ShuttingDown() }

const (
	srcAdd  = "add"  // the library's own Add: Send, the flush in Start, RetryNow
	srcFire = "fire" // the delay heap's timer
)

func newGen(s *session, n int) *gen {
	g := &gen{s: s, n: n, adds: &metric{}, mem: map[*req.Envelope]*member{}}
	g.raw = workqueue.NewTypedWithConfig[*req.Envelope](workqueue.TypedQueueConfig[*req.Envelope]{
		Name: fmt.Sprintf("conform-gen%d", n), MetricsProvider: provider{adds: g.adds}})
	g.real = workqueue.NewTypedDelayingQueueWithConfig[*req.Envelope](
		workqueue.TypedDelayingQueueConfig[*req.Envelope]{Queue: fire{g}})
	return g
}

// add: an Add reaching the Typed queue, from the library (srcAdd) or from the delay heap (srcFire).
func (g *gen) add(e *req.Envelope, src string) {
	mu.Lock()
	defer mu.Unlock()
	activity.Add(1)
	m := g.memberOf(e)
	if src == srcFire {
		m.delayed = false
	}
	rec := recs[e]
	if rec != nil && src == srcAdd && rec.s.starting && rec.pending > 0 {
		rec.pending-- // Start() flushing its pre-start buffer (queue.go:471-482)
	}
	before := g.adds.n.Load()
	g.raw.Add(e)
	inserted := g.adds.n.Load() != before
	if inserted {
		m.dirty = true
		if !m.processing {
			m.queued = true
			g.qlen++
			cond.Broadcast()
		}
	}
	// not inserted: already dirty (deduplicated by client-go) or ignored (shutting down)
	if rec != nil {
		rec.s.update(rec, nil)
	}
}

// The TypedDelayingInterface the library's rateLimitingType wraps.

func (g *gen) Add(e *req.Envelope) { g.add(e, srcAdd) }
func (g *gen) Len() int            { return g.raw.Len() }
func (g *gen) ShuttingDown() bool  { return g.raw.ShuttingDown() }

func (g *gen) Get() (*req.Envelope, bool) {
	mu.Lock()
	defer mu.Unlock()
	activity.Add(1)
	for g.qlen == 0 && !g.raw.ShuttingDown() {
		cond.Wait()
	}
	// Something is queued, or the queue is shutting down: the real Get returns at once.
	e, shutdown := g.raw.Get()
	activity.Add(1)
	if shutdown {
		return e, shutdown
	}
	m := g.memberOf(e)
	m.queued, m.dirty, m.processing = false, false, true
	g.qlen--
	if rec := recs[e]; rec != nil {
		rec.beginAttempt()
		rec.s.update(rec, nil)
	}
	return e, shutdown
}

func (g *gen) Done(e *req.Envelope) {
	mu.Lock()
	defer mu.Unlock()
	activity.Add(1)
	g.raw.Done(e)
	m := g.memberOf(e)
	m.processing = false
	if m.dirty { // re-added while it ran: client-go pushes it to the FIFO now (wq/queue.go:286-289)
		m.queued = true
		g.qlen++
	}
	cond.Broadcast()
	if rec := recs[e]; rec != nil {
		rec.endAttempt()
	}
}

func (g *gen) AddAfter(e *req.Envelope, d time.Duration) {
	mu.Lock()
	activity.Add(1)
	if !g.raw.ShuttingDown() && d > 0 {
		m := g.memberOf(e)
		at := time.Now().Add(d)
		if !m.delayed || at.Before(m.readyAt) { // the heap keeps the earlier readyAt (delaying_queue.go:355-369)
			m.readyAt = at
		}
		m.delayed = true
	}
	mu.Unlock()
	// Outside mu: a non-positive delay makes the delaying queue call Add (which takes mu).
	g.real.AddAfter(e, d)
}

// lose: the delay heap of a generation whose Typed queue is shutting down will never add anything
// again (its timers' Adds are ignored, delaying_queue.go:249-253 and wq/queue.go:221-223).
func (g *gen) lose() {
	g.shut = true
	for e, m := range g.mem {
		if m.delayed {
			m.delayed = false
			if rec := recs[e]; rec != nil {
				rec.s.update(rec, nil) // lost: no protocol state, so update() reports nothing for it
			}
		}
	}
	cond.Broadcast()
}

func (g *gen) ShutDown() {
	mu.Lock()
	defer mu.Unlock()
	activity.Add(1)
	g.s.syncLife()
	g.real.ShutDown() // the Typed queue's ShutDown, then the delaying loop stops (delaying_queue.go:240-246)
	g.lose()
}

func (g *gen) ShutDownWithDrain() {
	mu.Lock()
	activity.Add(1)
	g.s.syncLife()
	mu.Unlock()
	// The delaying queue does not override ShutDownWithDrain: the library's call goes to the Typed
	// queue, which blocks until nothing is processing. It sets "shutting down" first; once it has,
	// the driver notes it (and wakes the workers waiting in Get, which then see the shutdown).
	go func() {
		for !g.raw.ShuttingDown() {
			time.Sleep(20 * time.Microsecond)
		}
		mu.Lock()
		activity.Add(1)
		g.lose()
		mu.Unlock()
	}()
	g.raw.ShutDownWithDrain()
}
