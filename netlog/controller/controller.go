// Package controller is the dynamic resource controller of a node's sender-side log (seed 004's FTM
// controller, adapted to sender-based logging): it keeps the log's memory under a cap without ever
// dropping logged bytes. The cap itself is enforced by the log's consumer (netlog/capture); the controller
// decides what relieves the pressure and reports it.
//
// Logged bytes destined for node Q can be freed only once Q's snapshot covers their receipt. So when the
// log crosses its high watermark, the controller asks the destination nodes that hold the oldest logged
// bytes to snapshot now; their snapshots let this node trim. Spilling to disk is the last resort, used
// only if memory is still high after those snapshots had time to complete. At the cap itself the
// controller pauses the log's consumer: the eBPF probe then drops egress packets on a full ring buffer and
// TCP retransmits them later, so senders slow down instead of bytes being lost.
//
// The package holds only decisions; the agent feeds it measurements and carries out its actions.
package controller

import (
	"errors"
	"fmt"
	"sort"
	"time"
)

// Config bounds the log's memory.
type Config struct {
	Cap  int64   // bytes of RAM the log may hold; never exceeded
	High float64 // fraction of Cap at which snapshots are requested (default 0.8)
	Low  float64 // fraction of Cap the controller aims for (default 0.6)
	// Cooldown is how long an unanswered snapshot request to one node stands before it is repeated
	// (default 30 s); a node whose snapshot trimmed the log may be asked again at once (Relieved).
	Cooldown time.Duration
	// PausedRetry replaces Cooldown while the log is paused at its cap (default 2 s): the jobs' segments
	// are held back then, and TCP gives up on a connection within seconds (ci258: 10 s after a lost
	// request). A receiver folds repeated requests into one snapshot after the one it is taking.
	PausedRetry time.Duration
	// SpillGrace is how long memory may stay above High, with requests outstanding, before spilling
	// (default 10 s: a snapshot and its shipping normally finish well within it).
	SpillGrace time.Duration
}

func (c Config) withDefaults() (Config, error) {
	if c.High == 0 {
		c.High = 0.8
	}
	if c.Low == 0 {
		c.Low = 0.6
	}
	if c.Cooldown == 0 {
		c.Cooldown = 30 * time.Second
	}
	if c.PausedRetry == 0 {
		c.PausedRetry = 2 * time.Second
	}
	if c.SpillGrace == 0 {
		c.SpillGrace = 10 * time.Second
	}
	switch {
	case c.Cap <= 0:
		return c, errors.New("log memory cap must be positive")
	case !(0 < c.Low && c.Low < c.High && c.High <= 1):
		return c, fmt.Errorf("watermarks must satisfy 0 < low (%.2f) < high (%.2f) <= 1", c.Low, c.High)
	}
	return c, nil
}

// Destination is what the log holds for one receiving node.
type Destination struct {
	Node   string
	Bytes  int64     // logged bytes in RAM destined for Node
	Oldest time.Time // when the oldest of them was logged
}

// State is one measurement.
type State struct {
	Now          time.Time
	Memory       int64 // bytes of RAM the log holds
	Destinations []Destination
	CanSpill     bool // a spill directory with room is configured
	// Paused says the log's consumer holds back at the cap (capture.Counters.ConsumerPaused). It stops one
	// append's worst case short of Cap, so Memory alone never reaches Cap while the jobs' segments wait.
	Paused bool
}

// Action is what the agent must do now.
type Action struct {
	RequestSnapshots []string // ask these nodes to snapshot now, oldest logged bytes first
	SpillBytes       int64    // move this many bytes of the oldest log data to disk
	Pause            bool     // the log is at its cap: its consumer holds back (TCP backpressure) until false
}

// EventKind names a controller decision.
type EventKind string

const (
	EventHigh     EventKind = "above-high-watermark"
	EventRequest  EventKind = "snapshot-requested"
	EventSpill    EventKind = "spill"
	EventPause    EventKind = "pause-consumer"
	EventResume   EventKind = "resume-consumer"
	EventRelieved EventKind = "below-low-watermark"
)

// Event is a decision worth logging and showing in `ftctl status`.
type Event struct {
	Time   time.Time `json:"time"`
	Kind   EventKind `json:"kind"`
	Node   string    `json:"node,omitempty"`
	Bytes  int64     `json:"bytes,omitempty"`
	Memory int64     `json:"memory"`
}

// Controller decides, one measurement at a time.
type Controller struct {
	cfg           Config
	lastRequest   map[string]time.Time
	pressureSince time.Time // zero when not above High
	// highSince is when memory last rose above High (zero below it): the spill grace counts from there, not
	// from pressureSince, which a dip between the watermarks keeps.
	highSince time.Time
	paused    bool
}

// New returns a controller for cfg.
func New(cfg Config) (*Controller, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	return &Controller{cfg: cfg, lastRequest: map[string]time.Time{}}, nil
}

// Config returns the effective configuration.
func (c *Controller) Config() Config { return c.cfg }

// Relieved records that node's requested snapshot arrived (its receive points trimmed this node's log):
// the next pressure may ask it again at once instead of waiting out the cooldown, which remains only as
// the timeout of a request that got lost.
func (c *Controller) Relieved(node string) { delete(c.lastRequest, node) }

// Step takes a measurement and returns the actions to take and the events to record.
func (c *Controller) Step(s State) (Action, []Event) {
	var a Action
	var ev []Event
	high := int64(float64(c.cfg.Cap) * c.cfg.High)
	low := int64(float64(c.cfg.Cap) * c.cfg.Low)
	emit := func(k EventKind, node string, bytes int64) {
		ev = append(ev, Event{Time: s.Now, Kind: k, Node: node, Bytes: bytes, Memory: s.Memory})
	}

	// Pause at the cap, resume once back under the high watermark (hysteresis avoids flapping).
	switch {
	case !c.paused && (s.Memory >= c.cfg.Cap || s.Paused):
		c.paused = true
		emit(EventPause, "", 0)
	case c.paused && !s.Paused && s.Memory < high:
		c.paused = false
		emit(EventResume, "", 0)
	}
	a.Pause = c.paused

	// A paused consumer is pressure whatever the watermarks: with High near 1 it pauses below High.
	if s.Memory < high && !s.Paused {
		c.highSince = time.Time{}
		if !c.pressureSince.IsZero() && s.Memory <= low {
			c.pressureSince = time.Time{}
			emit(EventRelieved, "", 0)
		}
		return a, ev
	}
	if c.pressureSince.IsZero() {
		c.pressureSince = s.Now
		emit(EventHigh, "", 0)
	}
	if c.highSince.IsZero() {
		c.highSince = s.Now
	}

	// Ask the nodes holding the oldest bytes to snapshot, until what they hold covers the excess over Low.
	dests := append([]Destination(nil), s.Destinations...)
	sort.SliceStable(dests, func(i, j int) bool { return dests[i].Oldest.Before(dests[j].Oldest) })
	need := max(s.Memory-low, 1) // paused below Low: ask for the oldest bytes all the same
	var covered int64
	cooldown := c.cfg.Cooldown
	if c.paused {
		cooldown = min(cooldown, c.cfg.PausedRetry)
	}
	for _, d := range dests {
		if covered >= need || d.Bytes == 0 {
			continue
		}
		covered += d.Bytes
		if last, ok := c.lastRequest[d.Node]; ok && s.Now.Sub(last) < cooldown {
			continue // already asked; its snapshot is on its way
		}
		c.lastRequest[d.Node] = s.Now
		a.RequestSnapshots = append(a.RequestSnapshots, d.Node)
		emit(EventRequest, d.Node, d.Bytes)
	}

	// Still high after the grace period: spill down to Low.
	if s.CanSpill && s.Now.Sub(c.highSince) >= c.cfg.SpillGrace && s.Memory > low {
		a.SpillBytes = s.Memory - low
		emit(EventSpill, "", a.SpillBytes)
	}
	return a, ev
}
