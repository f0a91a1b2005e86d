// The envq conformance driver for the Go library github.com/simplegear/rate-envelope-queue (v1,
// commit ee9bb00): it speaks the JSON-lines protocol of specs/driver-protocol.md on stdin/stdout
// and drives the real library, unpatched, on the real clock. See README.md.
//
// Build: ../../../shared/go-ref/go-ref.sh --driver drivers/go --out /ABSOLUTE/PATH/driver.bin
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"os"
	"strings"
	"time"

	req "github.com/simplegear/rate-envelope-queue"
	"k8s.io/client-go/util/workqueue"
)

const (
	protocolVersion = 1
	// settleMin/settleMax: the real pause after every command (the protocol's settle), well under
	// the smallest generated duration (0.5 model s) times the default time scale (0.05): 25 ms.
	settleMin = 2 * time.Millisecond
	settleMax = 6 * time.Millisecond
	// guard: how long a blocking call with no limit may wait (real time), under the harness's own
	// 60 s answer timeout.
	guard = 50 * time.Second
)

// features: what the library really has (README.md says why each other one is missing).
var features = []string{
	"buffer",        // Send in StateInit buffers, Start flushes (queue.go:369-385, 471-482)
	"deadline",      // WithDeadline: context.WithTimeout per attempt (queue.go:195-200)
	"dedup",         // client-go dedups the same pointer while it is queued (README "Deduplication")
	"on_failure",    // WithFailureHook: drop / RetryNow / RetryAfter; a panicking hook is recovered
	"periodic",      // WithScheduleModeInterval (queue.go:264-268, 323-326)
	"restart",       // Start() after Stop() makes a fresh workqueue (queue.go:428-483)
	"stop_envelope", // ErrStopEnvelope (queue.go:253-256)
	"stop_nowait",   // WithWaitingOption(false) (queue.go:511-528); Stop() on its own goroutine
}

type command struct {
	Cmd       string          `json:"cmd"`
	Protocol  *int            `json:"protocol"`
	TimeScale *float64        `json:"time_scale"`
	Workers   *int            `json:"workers"`
	Capacity  *float64        `json:"capacity"`
	StopMode  *string         `json:"stop_mode"`
	Wait      *bool           `json:"wait"`
	Env       *string         `json:"env"`
	Spec      json.RawMessage `json:"spec"`
	Plan      *string         `json:"plan"`
	Envs      []string        `json:"envs"`
	Mode      *string         `json:"mode"`
	Cancel    *bool           `json:"cancel"`
	Limit     *float64        `json:"limit"`
	Seconds   *float64        `json:"seconds"`
}

// driverError: a command the driver cannot carry out (a protocol violation, not a library error).
type driverError struct{ msg string }

func (e driverError) Error() string { return e.msg }

func dErr(format string, args ...any) error { return driverError{fmt.Sprintf(format, args...)} }

// callError: what a library call returned, by the protocol's name.
type callError struct {
	name string
	err  error
}

func (e callError) Error() string { return e.err.Error() }

func libraryError(err error) error {
	if err == nil {
		return nil
	}
	name := "other:" + err.Error()
	switch {
	case errors.Is(err, req.ErrEnvelopeQueueIsNotRunning):
		name = "queue_not_running"
	case errors.Is(err, req.ErrQueueIsTerminated):
		name = "queue_terminated"
	case errors.Is(err, req.ErrAllowedQueueCapacityExceeded):
		name = "capacity_exceeded"
	case errors.Is(err, req.ErrAdditionEnvelopeToQueueBadFields),
		errors.Is(err, req.ErrAdditionEnvelopeToQueueBadIntervals):
		name = "bad_envelope"
	}
	return callError{name, err}
}

// logWriter: the library logs through the std log package; its lines go to stderr, and the one it
// writes right after entering StateStopped (queue.go:539) is a moment to report the move.
type logWriter struct{}

func (logWriter) Write(p []byte) (int, error) {
	msg := strings.TrimSpace(string(p))
	if i := strings.IndexByte(msg, '\n'); i >= 0 { // a recovered panic logs its stack: keep line 1
		msg = msg[:i]
	}
	fmt.Fprintln(os.Stderr, msg)
	if strings.Contains(msg, "queue is drained/stopped") {
		mu.Lock()
		if cur != nil {
			cur.syncLife()
		}
		mu.Unlock()
	}
	return len(p), nil
}

func main() {
	log.SetFlags(0)
	log.SetOutput(logWriter{})
	mu.Lock()
	cur = newSession(0.05)
	mu.Unlock()
	in := bufio.NewReader(os.Stdin)
	out := bufio.NewWriter(os.Stdout)
	for {
		line, err := in.ReadString('\n')
		if strings.TrimSpace(line) != "" {
			resp, quit := handle([]byte(line))
			b, _ := json.Marshal(resp)
			out.Write(b)
			out.WriteByte('\n')
			out.Flush()
			if quit {
				return
			}
		}
		if err != nil {
			if err != io.EOF {
				fmt.Fprintln(os.Stderr, "driver: reading stdin:", err)
			}
			return
		}
	}
}

func handle(line []byte) (resp obs, quit bool) {
	var c command
	mu.Lock()
	s := cur
	s.at = -1
	mu.Unlock()
	var result any
	err := json.Unmarshal(line, &c)
	if err == nil {
		result, err = run(s, c)
	}
	mu.Lock()
	s = cur // reset replaces the session
	events := s.events
	s.events = nil
	at := s.at
	if at < 0 || at > len(events) {
		at = len(events)
	}
	t := s.now()
	mu.Unlock()
	if events == nil {
		events = []obs{}
	}
	resp = obs{"events": events, "at": at, "t": t}
	var de driverError
	var ce callError
	switch {
	case err == nil:
		resp["ok"], resp["result"] = true, result
	case errors.As(err, &ce):
		resp["ok"], resp["error"], resp["message"] = false, ce.name, ce.Error()
	case errors.As(err, &de):
		resp["ok"], resp["error"], resp["message"] = false, "DriverError", de.msg
	default: // malformed JSON and the like
		resp["ok"], resp["error"], resp["message"] = false, "DriverError", err.Error()
	}
	return resp, c.Cmd == "quit" && err == nil
}

// settle: a short real pause, longer while the library is still busy (see settleMin/settleMax).
func settle() {
	time.Sleep(settleMin)
	deadline := time.Now().Add(settleMax - settleMin)
	last := activity.Load()
	for time.Now().Before(deadline) {
		time.Sleep(500 * time.Microsecond)
		a := activity.Load()
		if a == last {
			return
		}
		last = a
	}
}

func run(s *session, c command) (any, error) {
	switch c.Cmd {
	case "hello":
		return s.hello(c)
	case "reset":
		mu.Lock()
		scale := s.scale
		cur = newSession(scale)
		mu.Unlock()
		s.close()
		return nil, nil
	case "quit":
		return nil, nil
	case "define":
		return nil, s.cmdDefine(c)
	case "plan":
		r, err := s.env(c.Env)
		if err != nil {
			return nil, err
		}
		if c.Plan == nil || checkPlan(*c.Plan) != nil {
			return nil, dErr("plan: bad plan %v", c.Plan)
		}
		mu.Lock()
		r.script = append(r.script, *c.Plan)
		mu.Unlock()
		return nil, nil
	case "queue":
		return nil, s.cmdQueue(c)
	case "advance":
		if c.Seconds == nil {
			return nil, dErr("advance: no seconds")
		}
		time.Sleep(seconds(*c.Seconds, s.scale))
		s.markLocked()
		settle()
		return nil, nil
	case "stats":
		if s.q == nil {
			return nil, dErr("no queue: send a 'queue' command first")
		}
		return s.cmdStats(), nil
	case "send_wait", "lend", "reclaim":
		return nil, dErr("%s: not supported by rate-envelope-queue (feature not declared)", c.Cmd)
	}
	if s.q == nil {
		switch c.Cmd {
		case "start", "send", "stop", "wait_stopped", "terminate", "release":
			return nil, dErr("no queue: send a 'queue' command first")
		}
	}
	switch c.Cmd {
	case "start":
		return nil, s.cmdStart()
	case "send":
		return nil, s.cmdSend(c)
	case "stop":
		return s.cmdStop(c)
	case "wait_stopped":
		return s.cmdWaitStopped(c)
	case "terminate":
		s.q.Terminate()
		s.markLocked()
		settle()
		return obs{"handed_back": []string{}}, nil // the library hands nothing back (queue.go:542-552)
	case "release":
		r, err := s.env(c.Env)
		if err != nil {
			return nil, err
		}
		if c.Plan == nil {
			return nil, dErr("release: no plan")
		}
		switch *c.Plan {
		case planOK, planError, planStop:
		default:
			return nil, dErr("release: plan %q not supported", *c.Plan)
		}
		ok := r.release(*c.Plan)
		s.markLocked()
		settle()
		return ok, nil
	}
	return nil, dErr("unknown command %q", c.Cmd)
}

func (s *session) markLocked() {
	mu.Lock()
	s.mark()
	mu.Unlock()
}

func (s *session) env(name *string) (*envRec, error) {
	if name == nil {
		return nil, dErr("no envelope named")
	}
	mu.Lock()
	defer mu.Unlock()
	r := s.envs[*name]
	if r == nil {
		return nil, dErr("unknown envelope %q", *name)
	}
	return r, nil
}

func (s *session) hello(c command) (any, error) {
	if c.Protocol != nil && *c.Protocol != protocolVersion {
		return nil, dErr("protocol %d unknown (speaks %d)", *c.Protocol, protocolVersion)
	}
	mu.Lock()
	if c.TimeScale != nil && *c.TimeScale > 0 {
		s.scale = *c.TimeScale
	}
	s.t0 = time.Now()
	mu.Unlock()
	return obs{
		"driver":      "rate-envelope-queue",
		"version":     "v1.x (commit ee9bb00)",
		"protocol":    protocolVersion,
		"clock":       "real",
		"features":    features,
		"divergences": []any{},
	}, nil
}

func (s *session) cmdDefine(c command) error {
	if c.Env == nil || *c.Env == "" {
		return dErr("define: no envelope name")
	}
	mu.Lock()
	_, dup := s.envs[*c.Env]
	s.nextID++
	id := s.nextID
	mu.Unlock()
	if dup {
		return dErr("define: duplicate envelope name %q", *c.Env)
	}
	sp, err := parseSpec(c.Spec)
	if err != nil {
		return dErr("define %s: %v", *c.Env, err)
	}
	r, err := s.define(*c.Env, sp, id)
	if err != nil {
		return dErr("define %s: NewEnvelope: %v", *c.Env, err)
	}
	mu.Lock()
	s.envs[*c.Env] = r
	recs[r.env] = r
	mu.Unlock()
	return nil
}

func (s *session) cmdQueue(c command) (err error) {
	workers, capacity, mode, wait := 1, uint64(0), "drain", true
	if c.Workers != nil {
		workers = *c.Workers
	}
	if c.Capacity != nil {
		capacity = uint64(*c.Capacity)
	}
	if c.StopMode != nil {
		mode = *c.StopMode
	}
	if c.Wait != nil {
		wait = *c.Wait
	}
	stopMode := req.Drain
	switch mode {
	case "drain":
	case "stop":
		stopMode = req.Stop
	default:
		return callError{"invalid_argument", fmt.Errorf("stop mode %q", mode)}
	}
	base, cancel := context.WithCancel(context.Background())
	var q req.SingleQueuePool
	func() {
		defer func() {
			if p := recover(); p != nil { // NewRateEnvelopeQueue panics on a bad limit (queue.go:101-106)
				err = callError{"invalid_argument", fmt.Errorf("%v", p)}
			}
		}()
		q = req.NewRateEnvelopeQueue(base, "conform",
			req.WithLimitOption(workers),
			req.WithAllowedCapacityOption(capacity),
			req.WithStopModeOption(stopMode),
			req.WithWaitingOption(wait),
			// a config, so that the driver can give each Start() its own instrumented generation
			req.WithWorkqueueConfigOption(&workqueue.TypedRateLimitingQueueConfig[*req.Envelope]{}),
		)
	}()
	if err != nil {
		cancel()
		return err
	}
	mu.Lock()
	s.q = q
	s.bases = append(s.bases, cancel)
	s.wait, s.mode = wait, mode
	s.life, s.run, s.last, s.stopping = "init", nil, emptyReport(), nil
	mu.Unlock()
	return nil
}

func (s *session) cmdStart() error {
	// A fresh generation for this Start() (the library reuses its config on every Start,
	// queue.go:445-450); unused if Start() does nothing.
	mu.Lock()
	s.nextGen++
	g := newGen(s, s.nextGen)
	mu.Unlock()
	before := s.q.CurrentState()
	workqueueConf(s.q).DelayingQueue = g
	mu.Lock()
	s.starting = true
	mu.Unlock()
	s.q.Start()
	mu.Lock()
	s.starting = false
	if before != req.StateRunning && s.q.CurrentState() == req.StateRunning {
		s.gens = append(s.gens, g)
		for _, r := range s.envs { // the library empties its pre-start buffer (queue.go:480)
			r.pending = 0
		}
	} else {
		g.shut = true
		g.real.ShutDown()
	}
	s.mark()
	mu.Unlock()
	settle()
	return nil
}

func (s *session) cmdSend(c command) error {
	batch := make([]*req.Envelope, 0, len(c.Envs))
	rs := make([]*envRec, 0, len(c.Envs))
	for _, name := range c.Envs {
		n := name
		r, err := s.env(&n)
		if err != nil {
			return err
		}
		batch = append(batch, r.env)
		rs = append(rs, r)
	}
	wasInit := s.q.CurrentState() == req.StateInit
	err := s.q.Send(batch...)
	mu.Lock()
	if err == nil && wasInit { // buffered: the library appends the batch to pending (queue.go:382)
		for _, r := range rs {
			r.pending++
			s.update(r, nil)
		}
	}
	s.mark()
	mu.Unlock()
	settle()
	return libraryError(err)
}

// cmdStop: the library's Stop(), on its own goroutine (it blocks while attempts run). The driver
// waits for it to return (bounded by limit) when the call's wait, or the queue's, says so; else it
// returns as soon as the library has left RUNNING.
func (s *session) cmdStop(c command) (any, error) {
	if c.Cancel != nil && *c.Cancel {
		return nil, dErr("stop(cancel=true): the library's Stop() cannot cancel (feature 'stop_cancel' not declared)")
	}
	if c.Mode != nil && *c.Mode != s.mode {
		return nil, dErr("stop(mode=%s): the stop mode is fixed when the queue is made (feature 'stop_modes' not declared)", *c.Mode)
	}
	wait := s.wait
	if c.Wait != nil {
		wait = *c.Wait
	}
	before := s.q.CurrentState()
	done := make(chan struct{})
	q := s.q
	go func() {
		q.Stop()
		mu.Lock()
		s.syncLife()
		mu.Unlock()
		close(done)
	}()
	if before == req.StateRunning {
		mu.Lock()
		s.stopping = done
		mu.Unlock()
	}
	timedOut := false
	if wait {
		timedOut = !waitFor(done, c.Limit, s.scale)
	} else {
		// until Stop() returned, or (from RUNNING) the library entered STOPPING
		end := time.Now().Add(200 * time.Millisecond)
		for time.Now().Before(end) && !closed(done) &&
			(before != req.StateRunning || q.CurrentState() == req.StateRunning) {
			time.Sleep(20 * time.Microsecond)
		}
	}
	mu.Lock()
	s.mark()
	var result any = s.report()
	if timedOut {
		result = obs{"timed_out": true}
	}
	mu.Unlock()
	settle()
	return result, nil
}

// cmdWaitStopped: the library has no such call; the driver waits for its latest Stop() call to
// return (bounded by limit), then gives the final report it observed.
func (s *session) cmdWaitStopped(c command) (any, error) {
	mu.Lock()
	done := s.stopping
	mu.Unlock()
	timedOut := false
	if done != nil {
		timedOut = !waitFor(done, c.Limit, s.scale)
	}
	mu.Lock()
	s.mark()
	var result any = s.report()
	if timedOut {
		result = obs{"timed_out": true}
	}
	mu.Unlock()
	settle()
	return result, nil
}

func closed(done chan struct{}) bool {
	select {
	case <-done:
		return true
	default:
		return false
	}
}

func waitFor(done chan struct{}, limit *float64, scale float64) bool {
	d := guard
	if limit != nil {
		d = seconds(*limit, scale)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
		return true
	case <-t.C:
		return false
	}
}

// cmdStats: the statistics, at a moment the capacity counter is not between two steps of a worker
// (the library decrements it just after Done, queue.go:185-186).
func (s *session) cmdStats() obs {
	for i := 0; ; i++ {
		a := activity.Load()
		c := capacityUsed(s.q)
		time.Sleep(200 * time.Microsecond)
		mu.Lock()
		if (activity.Load() == a && capacityUsed(s.q) == c) || i == 25 {
			s.syncLife()
			st := s.stats()
			mu.Unlock()
			return st
		}
		mu.Unlock()
	}
}
