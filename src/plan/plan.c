/*
 * plan.c - host build of the plan builder (plan_impl.h holds the code).
 */
#include "plan_impl.h"
