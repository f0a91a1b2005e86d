package main

// The session: the library queue under test, the scripted envelopes, what the driver has reported,
// and the observations not yet sent. Everything here is guarded by mu, the driver's one lock, which
// the instrumented workqueue (gen.go) also holds while it passes each call on.

import (
	"context"
	"reflect"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	req "github.com/simplegear/rate-envelope-queue"
	"k8s.io/client-go/util/workqueue"
)

type obs = map[string]any

var (
	mu   sync.Mutex
	cond = sync.NewCond(&mu)
	cur  *session
	// recs: every scripted envelope ever defined, by pointer (old sessions' goroutines may still
	// call the workqueue wrappers with theirs; their observations are dropped).
	recs = map[*req.Envelope]*envRec{}
	// activity: bumped on every call through the driver's wrappers (settling, stable stats).
	activity atomic.Int64
)

// ending: how an attempt ended, as the driver classified it.
type ending struct {
	outcome  string
	cause    *string
	terminal string // where it ends if the library holds it nowhere afterwards
}

type runLog struct{ completed, cancelled []string }

type session struct {
	scale    float64
	t0       time.Time
	q        req.SingleQueuePool
	bases    []context.CancelFunc // the base context of every queue made in this session
	wait     bool                 // the queue's waiting option
	mode     string               // the queue's stop mode
	life     string               // the lifecycle state last reported
	run      *runLog              // a stop under way (from RUNNING→STOPPING to STOPPING→STOPPED)
	last     obs                  // the last final stop report
	events   []obs
	at       int // observations made before the call under way returned (-1: all of them)
	envs     map[string]*envRec
	gens     []*gen
	nextGen  int
	nextID   uint64
	starting bool          // inside the library's Start()
	stopping chan struct{} // closed when the latest Stop() call returns
}

func newSession(scale float64) *session {
	return &session{scale: scale, t0: time.Now(), life: "init", last: emptyReport(), at: -1,
		envs: map[string]*envRec{}}
}

func emptyReport() obs {
	return obs{"parked": []string{}, "completed": []string{}, "cancelled": []string{}, "complete": false}
}

func (s *session) now() float64 { return time.Since(s.t0).Seconds() / s.scale }

// emit records one observation (under mu); a stale session's are dropped. Queue moves the library
// made since the last observation are reported first, so the order is the library's.
func (s *session) emit(kind string, fields obs) {
	if s != cur {
		return
	}
	s.syncLife()
	s.record(kind, fields)
}

func (s *session) record(kind string, fields obs) {
	fields["kind"] = kind
	fields["t"] = s.now()
	s.events = append(s.events, fields)
}

// ---------------------------------------------------------------- envelope moves

func isTerminal(state string) bool {
	switch state {
	case "succeeded", "failed", "stopped", "returned":
		return true
	}
	return false
}

// update reports an envelope's move if the library now holds it in another state (under mu). At
// the end of an attempt (end != nil) the move carries the outcome, and an envelope the library
// holds nowhere any more goes to end.terminal. Outside an attempt's end, an envelope the library
// stops holding without a word (a delayed one whose timer is dropped at Stop) has no protocol
// state to go to: it is not moved, and stays in the state last reported.
func (s *session) update(r *envRec, end *ending) {
	to := r.derived()
	if end == nil {
		if to == "" || to == r.state {
			return
		}
		s.move(r, to, nil, nil)
		return
	}
	if to == "" {
		to = end.terminal
	}
	if to == "running" { // another attempt of it runs (in another generation of the workqueue)
		return
	}
	o := end.outcome
	s.move(r, to, &o, end.cause)
}

func (s *session) move(r *envRec, to string, outcome, cause *string) {
	if s != cur {
		r.state = to
		return
	}
	from := r.state
	if from == "new" || isTerminal(from) { // a new stay
		from = "new"
		r.attempts = 0
	}
	var o, c any
	if outcome != nil {
		o = *outcome
	}
	if cause != nil {
		c = *cause
	}
	s.emit("move", obs{"env": r.name, "from": from, "to": to, "outcome": o, "cause": c})
	r.state = to
	if outcome != nil && s.run != nil {
		if *outcome == "cancelled" {
			s.run.cancelled = append(s.run.cancelled, r.name)
		} else {
			s.run.completed = append(s.run.completed, r.name)
		}
	}
}

// ---------------------------------------------------------------- the lifecycle

var lifeNames = map[req.QueueState]string{
	req.StateInit:      "init",
	req.StateRunning:   "running",
	req.StateStopping:  "stopping",
	req.StateStopped:   "stopped",
	req.StateTerminate: "terminated",
}

// nextLife: the library's lifecycle moves (queue.go:428-552): the step from one state towards
// another.
func nextLife(from, to string) string {
	switch from {
	case "init":
		return "running"
	case "running":
		return "stopping"
	case "stopping":
		return "stopped"
	case "stopped":
		if to == "terminated" {
			return "terminated"
		}
		return "running"
	}
	return ""
}

// syncLife reports the queue's lifecycle moves since the last report (under mu): the library's
// CurrentState(), read at every observation, at every call's return and when the library logs
// "queue is drained/stopped" (queue.go:539, right after it set StateStopped).
func (s *session) syncLife() {
	if s != cur || s.q == nil {
		return
	}
	now := lifeNames[s.q.CurrentState()]
	for i := 0; s.life != now && i < 4; i++ {
		to := nextLife(s.life, now)
		if to == "" {
			return
		}
		s.record("queue", obs{"from": s.life, "to": to})
		switch {
		case to == "stopping":
			s.run = &runLog{}
		case s.life == "stopping" && to == "stopped":
			run := s.run
			if run == nil {
				run = &runLog{}
			}
			s.last = obs{"parked": []string{}, "completed": names(run.completed),
				"cancelled": names(run.cancelled), "complete": true}
			s.run = nil
		}
		s.life = to
	}
}

func names(list []string) []string {
	if list == nil {
		return []string{}
	}
	return append([]string{}, list...)
}

// report: the stop report as the driver observed it (the library returns none): nothing is ever
// parked; the attempts that ended while the stop was under way; final once STOPPED.
func (s *session) report() obs {
	if s.life == "stopping" && s.run != nil {
		return obs{"parked": []string{}, "completed": names(s.run.completed),
			"cancelled": names(s.run.cancelled), "complete": false}
	}
	return s.last
}

// mark: the call under way returned; what is observed from now on comes after it.
func (s *session) mark() {
	s.syncLife()
	s.at = len(s.events)
}

// ---------------------------------------------------------------- reflection on the queue

// The library's queue is a *RateEnvelopeQueue behind the SingleQueuePool interface; its capacity
// counter (queue.go:64) and workqueue config (queue.go:42) are unexported fields.
func field(q req.SingleQueuePool, name string) unsafe.Pointer {
	return unsafe.Pointer(reflect.ValueOf(q).Elem().FieldByName(name).UnsafeAddr())
}

func capacityUsed(q req.SingleQueuePool) uint64 {
	return (*atomic.Uint64)(field(q, "currentCapacity")).Load()
}

func workqueueConf(q req.SingleQueuePool) *workqueue.TypedRateLimitingQueueConfig[*req.Envelope] {
	return *(**workqueue.TypedRateLimitingQueueConfig[*req.Envelope])(field(q, "workqueueConf"))
}

// stats: the library's state and capacity counter, and the driver's count of what it reported.
func (s *session) stats() obs {
	byState := obs{}
	for _, st := range []string{"buffered", "ready", "delayed", "running", "parked"} {
		byState[st] = 0
	}
	inFlight := 0
	for _, r := range s.envs {
		if _, live := byState[r.state]; live {
			byState[r.state] = byState[r.state].(int) + 1
		}
		if r.state == "running" {
			inFlight++
		}
	}
	return obs{"state": s.life, "capacity_used": capacityUsed(s.q), "by_state": byState,
		"in_flight": inFlight}
}

// ---------------------------------------------------------------- ending a session

// close silences a session and frees what it left running: its observations are dropped from now
// on; its queues' base contexts are cancelled (attempts in flight end) and its workqueues shut down
// (their workers leave).
func (s *session) close() {
	mu.Lock()
	gens := append([]*gen{}, s.gens...)
	bases := append([]context.CancelFunc{}, s.bases...)
	for _, r := range s.envs {
		delete(recs, r.env)
	}
	mu.Unlock()
	for _, cancel := range bases {
		cancel()
	}
	for _, g := range gens {
		g.real.ShutDown()
		mu.Lock()
		g.shut = true
		cond.Broadcast()
		mu.Unlock()
	}
}
