package main

// Scripted envelopes: each is a real *req.Envelope built with the library's options; its invoke
// carries out the plans of its script, its failure hook answers its policy, and a success hook
// (pure observation: it runs after the library has decided, queue.go:319-332) tells the driver the
// attempt ended OK.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	req "github.com/simplegear/rate-envelope-queue"
)

// The plans of the protocol the library can carry out (no StopType, no DoNotRetry in the library).
const (
	planOK    = "ok"
	planSlow  = "slow"
	planLong  = "long"
	planError = "error"
	planHang  = "hang"
	planStop  = "stop"
)

const (
	slowSeconds = 3.0   // envq.conform.protocol.SLOW_SECONDS
	longSeconds = 300.0 // envq.conform.protocol.LONG_SECONDS
)

var errPlanned = errors.New("planned error")

// spec: the protocol's scripted envelope (model seconds).
type spec struct {
	Type       string   `json:"type"`
	Interval   float64  `json:"interval"`
	Deadline   float64  `json:"deadline"`
	Delay      float64  `json:"delay"`
	FixedRate  bool     `json:"fixed_rate"`
	Policy     string   `json:"policy"`
	RetryAfter float64  `json:"retry_after"`
	Attempts   int      `json:"attempts"`
	Base       float64  `json:"base"`
	Cap        float64  `json:"cap"`
	Script     []string `json:"script"`
	Then       string   `json:"then"`
}

func parseSpec(raw json.RawMessage) (spec, error) {
	sp := spec{Policy: "none", RetryAfter: 2, Attempts: 3, Base: 1, Cap: 4, Then: planOK}
	if len(raw) > 0 {
		if err := json.Unmarshal(raw, &sp); err != nil {
			return sp, err
		}
	}
	// What the library cannot express is a protocol error: the driver did not declare it.
	switch {
	case sp.Delay != 0:
		return sp, fmt.Errorf("delay %v: the library has no first delay (feature 'delay' not declared)", sp.Delay)
	case sp.FixedRate:
		return sp, errors.New("fixed_rate: the library is fixed-delay only (feature 'fixed_rate' not declared)")
	case sp.Interval < 0 || sp.Deadline < 0:
		// the library would refuse it at Send (ErrAdditionEnvelopeToQueueBadFields); keep it so
	}
	switch sp.Policy {
	case "none", "drop", "decide_none", "retry_now", "retry_after", "crash":
	default:
		return sp, fmt.Errorf("policy %q: the library has no retry policy (feature 'retry_policy' not declared)", sp.Policy)
	}
	for _, p := range append(append([]string{}, sp.Script...), sp.Then) {
		if err := checkPlan(p); err != nil {
			return sp, err
		}
	}
	return sp, nil
}

func checkPlan(p string) error {
	switch p {
	case planOK, planSlow, planLong, planError, planHang, planStop:
		return nil
	}
	return fmt.Errorf("plan %q: the library has no such signal (StopType/DoNotRetry are not in rate-envelope-queue)", p)
}

func (sp spec) periodic() bool     { return sp.Interval > 0 }
func (sp spec) hasOnFailure() bool { return sp.Policy != "none" && sp.Policy != "retry" }

// gate: a hanging attempt, waiting for release, its deadline or a cancel.
type gate struct {
	ch       chan string
	released bool // release handed it a plan
	done     bool // it saw its context end first
}

// attempt: what the driver saw of one attempt (from Get to Done).
type attempt struct {
	plan       string
	ctx        context.Context
	invoked    bool
	invokeErr  error
	success    bool // the success hook ran: the library's outcome was nil (queue.go:319-332)
	failCalled bool
	failErr    error  // the error the failure hook was given (the library's "important")
	decision   string // the policy it answered
	gate       *gate
}

// envRec: one scripted envelope of a session.
type envRec struct {
	s        *session
	name     string
	spec     spec
	env      *req.Envelope
	script   []string
	state    string // the state last reported ("new" before its first admission)
	pending  int    // copies in the library's pre-start buffer (queue.go:369-385)
	gens     []*gen // generations with a mirror entry for it
	attempts int    // attempts of this stay
	att      *attempt
}

func (s *session) define(name string, sp spec, id uint64) (*envRec, error) {
	r := &envRec{s: s, name: name, spec: sp, script: append([]string{}, sp.Script...), state: "new"}
	scale := s.scale
	opts := []func(*req.Envelope){
		req.WithId(id),
		req.WithType(sp.Type),
		req.WithScheduleModeInterval(seconds(sp.Interval, scale)),
		req.WithDeadline(seconds(sp.Deadline, scale)),
		req.WithInvoke(r.invoke),
		req.WithSuccessHook(r.onSuccess),
	}
	if sp.hasOnFailure() {
		opts = append(opts, req.WithFailureHook(r.onFailure))
	}
	env, err := req.NewEnvelope(opts...)
	if err != nil {
		return nil, err
	}
	r.env = env
	return r, nil
}

func seconds(model, scale float64) time.Duration {
	return time.Duration(model * scale * float64(time.Second))
}

// derived: the protocol state the library's structures hold the envelope in, or "" if none
// (not in the queue: ended, or lost).
func (r *envRec) derived() string {
	ready, delayed := false, false
	for _, g := range r.gens {
		m := g.mem[r.env]
		if m.processing {
			return "running"
		}
		if m.queued {
			ready = true
		}
		if m.delayed && !g.shut {
			delayed = true
		}
	}
	switch {
	case ready:
		return "ready"
	case delayed:
		return "delayed"
	case r.pending > 0:
		return "buffered"
	}
	return ""
}

func (r *envRec) nextPlan() string {
	if len(r.script) > 0 {
		p := r.script[0]
		r.script = r.script[1:]
		return p
	}
	return r.spec.Then
}

// beginAttempt: a worker took it (under mu).
func (r *envRec) beginAttempt() {
	r.attempts++
	r.att = &attempt{}
}

// endAttempt: the worker called Done (under mu): the outcome, and where the library left it.
func (r *envRec) endAttempt() {
	a := r.att
	r.att = nil
	if a == nil {
		r.s.update(r, nil)
		return
	}
	outcome, cause := a.outcome()
	// If the library holds it nowhere after this attempt, it has forgotten it (queue.Forget and no
	// reschedule, queue.go:253-333; its capacity slot is released by dec()): the envelope ends, in
	// the terminal state of its outcome. That covers what the library does on purpose (a one-off's
	// success, a StopEnvelope, a dropped failure) and what it does when the queue is not alive (a
	// periodic envelope's or a retry's reschedule skipped, queue.go:264-268, 290-291, 323-326):
	// a periodic envelope then ends SUCCEEDED or FAILED, which the model flags.
	terminal := "failed"
	switch outcome {
	case "ok":
		terminal = "succeeded"
	case "stop":
		terminal = "stopped"
	}
	r.s.update(r, &ending{outcome: outcome, cause: cause, terminal: terminal})
}

// outcome: the protocol outcome and cause of an attempt, from the library's own classification:
// the error it handed the failure hook, else what invoke returned, else the attempt context's error
// (the library turns a nil result into tctx.Err() once that context has ended, queue.go:240-243).
func (a *attempt) outcome() (string, *string) {
	if a.success {
		return "ok", nil
	}
	var err error
	switch {
	case a.failCalled:
		err = a.failErr
	case a.invokeErr != nil:
		err = a.invokeErr
	case a.ctx != nil:
		err = a.ctx.Err()
	}
	if err == nil {
		return "ok", nil
	}
	o, c := classify(err)
	return o, &c
}

// classify: an error as the protocol's outcome and cause names.
func classify(err error) (string, string) {
	switch {
	case errors.Is(err, req.ErrStopEnvelope):
		return "stop", "stop"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout", "timeout"
	case errors.Is(err, context.Canceled):
		return "cancelled", "cancelled"
	case errors.Is(err, errPlanned):
		return "error", "error"
	}
	return "error", "other:" + fmt.Sprintf("%T", err)
}

// invoke: the envelope's invoke, called by the library's invoker chain.
func (r *envRec) invoke(ctx context.Context, _ *req.Envelope) error {
	mu.Lock()
	activity.Add(1)
	a := r.att
	if a == nil { // not taken through Get (cannot happen with the driver's generations)
		a = &attempt{}
		r.att = a
	}
	p := r.nextPlan()
	a.plan, a.ctx, a.invoked = p, ctx, true
	var g *gate
	if p == planHang {
		g = &gate{ch: make(chan string, 1)}
		a.gate = g
	}
	r.s.emit("invoke", obs{"env": r.name, "plan": p})
	scale := r.s.scale
	mu.Unlock()

	err := r.perform(ctx, p, g, scale)

	mu.Lock()
	a.invokeErr = err
	activity.Add(1)
	mu.Unlock()
	return err
}

func (r *envRec) perform(ctx context.Context, p string, g *gate, scale float64) error {
	switch p {
	case planOK:
		return nil
	case planError:
		return errPlanned
	case planStop:
		return req.ErrStopEnvelope
	case planSlow, planLong:
		d := slowSeconds
		if p == planLong {
			d = longSeconds
		}
		t := time.NewTimer(seconds(d, scale))
		defer t.Stop()
		select {
		case <-t.C:
			return nil
		case <-ctx.Done():
			r.sawCancel()
			return ctx.Err()
		}
	case planHang:
		select {
		case next := <-g.ch:
			return r.perform(ctx, next, nil, scale)
		case <-ctx.Done():
			mu.Lock()
			if g.released { // released just as its context ended: it goes on with the release
				mu.Unlock()
				return r.perform(ctx, <-g.ch, nil, scale)
			}
			g.done = true
			activity.Add(1)
			r.s.emit("cancelled", obs{"env": r.name})
			mu.Unlock()
			return ctx.Err()
		}
	}
	return fmt.Errorf("unknown plan %q", p)
}

func (r *envRec) sawCancel() {
	mu.Lock()
	activity.Add(1)
	r.s.emit("cancelled", obs{"env": r.name})
	mu.Unlock()
}

// release: let a hanging attempt go on with a plan; false if it is not hanging.
func (r *envRec) release(p string) bool {
	mu.Lock()
	defer mu.Unlock()
	a := r.att
	if a == nil || a.gate == nil || a.gate.done || a.gate.released {
		return false
	}
	a.gate.released = true
	a.gate.ch <- p
	return true
}

func (r *envRec) onSuccess(context.Context, *req.Envelope) {
	mu.Lock()
	activity.Add(1)
	if r.att != nil {
		r.att.success = true
	}
	mu.Unlock()
}

// onFailure: the envelope's failure hook; the library calls it for one-off envelopes only
// (queue.go:271).
func (r *envRec) onFailure(_ context.Context, _ *req.Envelope, err error) req.Decision {
	mu.Lock()
	activity.Add(1)
	policy := r.spec.Policy
	if a := r.att; a != nil {
		a.failCalled, a.failErr, a.decision = true, err, policy
	}
	_, cause := classify(err)
	r.s.emit("on_failure", obs{"env": r.name, "error": cause, "attempt": r.attempts})
	retryAfter := seconds(r.spec.RetryAfter, r.s.scale)
	mu.Unlock()
	switch policy {
	case "retry_now":
		return req.RetryOnceNowDecision()
	case "retry_after":
		return req.RetryOnceAfterDecision(retryAfter)
	case "decide_none":
		return nil
	case "crash":
		panic("on_failure crashed (planned)") // recovered by the worker (queue.go:187-193)
	}
	return req.DefaultOnceDecision()
}
