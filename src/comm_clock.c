/* --- >>comm:clock the clock ---------------------------------------------- */

FSDP_API double fsdp_clock_ms(void)
{
    struct timespec ts;
#ifdef CLOCK_MONOTONIC
    clock_gettime(CLOCK_MONOTONIC, &ts);
#else
    timespec_get(&ts, TIME_UTC);
#endif
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

FSDP_API double fsdp_deadline_ms(int timeout_ms)
{
    return timeout_ms < 0 ? -1.0 : fsdp_clock_ms() + (double)timeout_ms;
}

FSDP_API int fsdp_deadline_left_ms(double deadline_ms)
{
    double left;
    if (deadline_ms < 0) return -1;
    left = deadline_ms - fsdp_clock_ms();
    return left < 1.0 ? 1 : left > 2e9 ? 2000000000 : (int)left;
}

FSDP_API void fsdp_sleep_us(long us)
{
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct timespec ts;
    if (us <= 0) return;
    timespec_get(&ts, TIME_UTC);
    ts.tv_sec += us / 1000000L;
    ts.tv_nsec += (us % 1000000L) * 1000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec += 1;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&cv, NULL);
    pthread_mutex_lock(&mu);
    while (pthread_cond_timedwait(&cv, &mu, &ts) == 0) { /* nobody signals: a sleep */
    }
    pthread_mutex_unlock(&mu);
    pthread_cond_destroy(&cv);
    pthread_mutex_destroy(&mu);
}

/* ms from now as pthread_cond_timedwait wants it: on TIME_UTC, the default
   clock of a condition variable (choosing another needs POSIX feature
   macros the user may not have defined). Not a second clock: the local
   backend's waits are on a condition variable, and it reads the time only
   when it has to wait. */
FSDP__DEF struct timespec fsdp__cond_deadline(int ms)
{
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec += 1;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

