// Package interval decides how often to checkpoint: a fixed period, or the
// optimum of Daly's higher-order model from a measured dump cost and a
// configured MTBF. Young's first-order formula is provided for comparison.
package interval

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"time"
)

// Young is Young's first-order optimum: sqrt(2·d·M), for checkpoint cost d
// and mean time between failures M.
func Young(cost, mtbf time.Duration) time.Duration {
	if cost <= 0 || mtbf <= 0 {
		return 0
	}
	return seconds(math.Sqrt(2 * cost.Seconds() * mtbf.Seconds()))
}

// Daly is Daly's higher-order optimum (FGCS 2006):
//
//	tau = sqrt(2dM)·[1 + (1/3)·sqrt(d/2M) + (1/9)·(d/2M)] − d   for d < 2M
//	tau = M                                                     for d ≥ 2M
//
// tau is the compute time between the end of one checkpoint and the start
// of the next.
func Daly(cost, mtbf time.Duration) time.Duration {
	if mtbf <= 0 {
		return 0
	}
	if cost <= 0 {
		return 0
	}
	d, m := cost.Seconds(), mtbf.Seconds()
	if d >= 2*m {
		return mtbf
	}
	x := d / (2 * m)
	return seconds(math.Sqrt(2*d*m)*(1+math.Sqrt(x)/3+x/9) - d)
}

func seconds(s float64) time.Duration {
	ns := math.Round(s * float64(time.Second))
	if ns >= math.MaxInt64 {
		// Beyond the longest duration (some 292 years): converted, it wrapped negative, and Interval's floor
		// made the longest period the shortest.
		return math.MaxInt64
	}
	return time.Duration(ns)
}

// Formula selects the model an automatic policy uses.
type Formula int

const (
	FormulaDaly Formula = iota
	FormulaYoung
)

// Config configures a Policy. Set Fixed for a fixed period; otherwise the
// period is derived from MTBF and the smoothed dump cost.
type Config struct {
	// Fixed, if non-zero, is the period, and the other fields are ignored.
	Fixed time.Duration
	// MTBF is the mean time between failures seen by one node's job part.
	MTBF time.Duration
	// InitialCost is the dump cost assumed before the first Observe.
	InitialCost time.Duration
	// Alpha is the EWMA weight of a new observation, in (0,1]; 0 means 0.3. A fixed period smooths the
	// cost too (Cost).
	Alpha float64
	// Min and Max clamp the automatic period; 0 means 1 s and no maximum.
	// A floor matters because a tiny cost would otherwise ask for
	// back-to-back dumps.
	Min, Max time.Duration
	Formula  Formula
}

// Policy gives the current checkpoint interval. It is safe for concurrent use.
type Policy struct {
	cfg  Config
	mu   sync.Mutex
	cost time.Duration // smoothed dump cost
	n    int           // observations so far
}

// New checks cfg and returns a policy.
func New(cfg Config) (*Policy, error) {
	if cfg.Fixed < 0 {
		return nil, errors.New("checkpoint interval: fixed period must not be negative")
	}
	// A fixed period smooths the dump cost too: Cost still serves its caller (the agent's interval for a
	// predicted failure), and an alpha of 0 would keep the first dump's cost for ever.
	if cfg.Alpha == 0 {
		cfg.Alpha = 0.3
	}
	if !(cfg.Alpha > 0 && cfg.Alpha <= 1) {
		return nil, fmt.Errorf("checkpoint interval: alpha %v must be in (0,1]", cfg.Alpha)
	}
	if cfg.Fixed == 0 {
		if cfg.MTBF <= 0 {
			return nil, errors.New("checkpoint interval: set either a fixed period or an MTBF for the automatic one")
		}
		if cfg.InitialCost <= 0 {
			return nil, errors.New("checkpoint interval: automatic mode needs a positive initial dump cost estimate")
		}
		if cfg.Min == 0 {
			cfg.Min = time.Second
		}
		if cfg.Min < 0 || cfg.Max < 0 || (cfg.Max > 0 && cfg.Max < cfg.Min) {
			return nil, fmt.Errorf("checkpoint interval: bad clamp [%v, %v]", cfg.Min, cfg.Max)
		}
		if cfg.Formula != FormulaDaly && cfg.Formula != FormulaYoung {
			return nil, fmt.Errorf("checkpoint interval: unknown formula %d", cfg.Formula)
		}
	}
	return &Policy{cfg: cfg, cost: cfg.InitialCost}, nil
}

// Observe feeds the wall time one dump cost the job.
func (p *Policy) Observe(cost time.Duration) {
	if cost < 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n == 0 {
		p.cost = cost // the first measurement beats the configured guess
	} else {
		p.cost = time.Duration(math.Round(p.cfg.Alpha*float64(cost) + (1-p.cfg.Alpha)*float64(p.cost)))
	}
	p.n++
}

// SetMTBF changes the MTBF an automatic policy computes the interval for (a failure predictor that started
// or stopped answering changes which failures are left to checkpoints). A non-positive one, which New
// refuses, is ignored.
func (p *Policy) SetMTBF(mtbf time.Duration) {
	if mtbf <= 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cfg.MTBF = mtbf
}

// Cost is the smoothed dump cost currently used.
func (p *Policy) Cost() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cost
}

// Interval is the time to wait after a checkpoint ends before starting the next.
func (p *Policy) Interval() time.Duration {
	if p.cfg.Fixed > 0 {
		return p.cfg.Fixed
	}
	p.mu.Lock()
	cost, mtbf := p.cost, p.cfg.MTBF
	p.mu.Unlock()
	var tau time.Duration
	if p.cfg.Formula == FormulaYoung {
		tau = Young(cost, mtbf)
	} else {
		tau = Daly(cost, mtbf)
	}
	tau = max(tau, p.cfg.Min)
	if p.cfg.Max > 0 {
		tau = min(tau, p.cfg.Max)
	}
	return tau
}
